"""EMULATION beside SIMULATION: prefix caching on the paper's emulated cluster with the
shared-prefix workload (``tetris/sim/prefix_workload.py``), the cache off and on.

1. The seeded trace is made once; each request's prompt tokens are made from its segments
   (a segment's tokens are drawn from a generator seeded by its content key), so two live
   prompts share a block exactly when the simulator's segment hashes say they do.
2. The simulator runs the trace with the cache off and on (``run_prefix``: prefill only, its
   TTFT is the prefill's end).
3. The live app runs it twice on one Ray instance, once per setting, time-scaled as
   ``tetris bench fidelity`` scales it (``scale_deployment``); after each run the cache is
   cleared and the app must come to hold nothing (``/admin/held``).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from pathlib import Path

import msgspec
import numpy as np

from tetris.bench.fidelity import scale_deployment
from tetris.bench.fidelity_live import LiveCluster
from tetris.config import DeploymentConfig

__all__ = ["PrefixLiveCluster", "prompt_tokens", "run_live", "wait_idle"]

_VOCAB_USED = 100_000   # ids drawn below this: inside LLaMA3's 128256


def prompt_tokens(segments) -> tuple[int, ...]:
    """A prompt's token ids from its ``(key, tokens)`` segments, the same for the same key."""
    parts = [np.random.default_rng(zlib.crc32(key.encode())).integers(1, _VOCAB_USED, n)
             for key, n in segments]
    return tuple(np.concatenate(parts).tolist()) if parts else ()


class PrefixLiveCluster(LiveCluster):
    """The emulated app sent each request's own prompt (``segments``: request id -> segments)."""

    def __init__(self, deployment: DeploymentConfig, segments: dict, *, app_name: str) -> None:
        super().__init__(deployment, app_name=app_name)
        self.segments = segments

    def prompt_of(self, r) -> tuple[int, ...]:
        return prompt_tokens(self.segments[r.request_id])


def wait_idle(live: LiveCluster, timeout_s: float) -> dict:
    """Poll ``/admin/held`` until nothing is held (or the timeout): what is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = live.held()
        left = {"inflight": held["dispatcher"]["inflight"],
                "prefill_runs": sum(len(v) for v in held["prefill"].values()),
                "decode_busy_ranks": sum(1 for inst in held["decode"] for r in inst["ranks"]
                                         if not r["empty"])}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _with_cache(cfg: DeploymentConfig, enabled: bool, block_tokens: int,
                capacity_blocks: int) -> DeploymentConfig:
    pc = msgspec.structs.replace(cfg.prefix_cache, enabled=enabled, block_tokens=block_tokens,
                                 capacity_blocks=capacity_blocks)
    return msgspec.structs.replace(cfg, prefix_cache=pc)


def run_live(base: DeploymentConfig, trace, segments: dict, *, cache: bool, block_tokens: int,
             capacity_blocks: int, time_scale: float, workdir: Path) -> dict:
    """One live run of ``trace`` (Ray already started); TTFTs in paper seconds."""
    cfg = scale_deployment(_with_cache(base, cache, block_tokens, capacity_blocks),
                           time_scale, workdir)
    name = f"prefix-{'on' if cache else 'off'}"
    with PrefixLiveCluster(cfg, segments, app_name=name) as live:
        t0 = time.perf_counter()
        got = asyncio.run(live.run_trace(trace, time_scale))
        wall = time.perf_counter() - t0
        stats = live.dispatcher.prefix_cache.remote(clear=True).result(timeout_s=120)
        left = wait_idle(live, 60.0 * max(1.0, time_scale))
    return {"cache": cache, "ttft_s": got["ttft_s"], "prefill_ttft_s": got["prefill_ttft_s"],
            "failed": got["failed"], "errors": got["errors"], "wall_s": wall,
            "startup_s": live.startup_s, "index": stats, "held_after_clear": left}
