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
4. Capacity (``live_capacity``): on one app per setting, the trace at each probed rate (the
   same requests, arrivals scaled), the cache cleared and the app idle between probes (each
   probe starts cold, as each simulated run does), searched by the simulator's own bisection
   (``prefix_experiments.bisect_capacity``) against one (P50, P99) SLO.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from tetris.bench.fidelity import scale_deployment
from tetris.bench.fidelity_live import LiveCluster
from tetris.config import DeploymentConfig
from tetris.sim.prefix_experiments import bisect_capacity

__all__ = ["PrefixLiveCluster", "live_capacity", "live_cluster", "live_probe", "prompt_tokens",
           "run_live", "wait_idle"]

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
                capacity_blocks: int, decode_runs: int = 0) -> DeploymentConfig:
    pc = msgspec.structs.replace(cfg.prefix_cache, enabled=enabled, block_tokens=block_tokens,
                                 capacity_blocks=capacity_blocks,
                                 decode_runs=decode_runs if enabled else 0)
    return msgspec.structs.replace(cfg, prefix_cache=pc)


def live_cluster(base: DeploymentConfig, segments: dict, *, cache: bool, block_tokens: int,
                 capacity_blocks: int, time_scale: float, workdir: Path,
                 decode_runs: int = 0) -> PrefixLiveCluster:
    """The emulated app of ``base`` with the cache ``cache`` (``decode_runs`` finished runs
    kept per emulated decode instance for decode-side reuse), slowed by ``time_scale`` (enter
    it with ``with``; Ray already started)."""
    cfg = scale_deployment(_with_cache(base, cache, block_tokens, capacity_blocks, decode_runs),
                           time_scale, workdir)
    name = "on" if cache else "off"
    return PrefixLiveCluster(cfg, segments,
                             app_name=f"prefix-{name}{'-decode' if cache and decode_runs else ''}")


def live_probe(live, trace, time_scale: float) -> dict:
    """``trace`` through the app, then the cache cleared and the app idle: TTFTs in paper
    seconds, the probe's own hits and queries, what is held after the clearing."""
    before = live.dispatcher.prefix_cache.remote().result(timeout_s=120)
    t0 = time.perf_counter()
    got = asyncio.run(live.run_trace(trace, time_scale))
    wall = time.perf_counter() - t0
    stats = live.dispatcher.prefix_cache.remote(clear=True).result(timeout_s=120)
    left = wait_idle(live, 60.0 * max(1.0, time_scale))
    hits = {k: stats.get(k, 0) - before.get(k, 0)
            for k in ("hits", "queries", "decode_reuses", "decode_reused_tokens")}
    return {"ttft_s": got["ttft_s"], "prefill_ttft_s": got["prefill_ttft_s"],
            "failed": got["failed"], "errors": got["errors"], "wall_s": wall, "index": stats,
            "probe_hits": hits, "held_after_clear": left,
            "timelines": [_timeline(t) for t in got["timelines"]]}


def _timeline(t: dict) -> dict:
    keep = ("request_id", "prompt_tokens", "arrival", "planned", "prefill_start", "prefill_end",
            "first_output", "turn_wait_s", "chunks", "sp_sizes", "ttft_estimate")
    return {k: t[k] for k in keep if k in t}


def _percentile(xs, q: float) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.percentile(xs, q)) if xs else float("nan")


def live_capacity(live, trace_at: Callable[[float], list], slo: tuple[float, float], *,
                  lo: float, hi: float, tol: float, max_rate: float,
                  time_scale: float) -> tuple[float, list[dict]]:
    """The highest rate whose caller TTFT P50 and P99 (paper seconds) meet ``slo`` with no
    request failed; ``trace_at(rate)`` is the trace at that rate. Returns the rate and the
    probes (rate, P50, P99, met, the probe's figures)."""
    probes: list[dict] = []

    def ok(rate: float) -> bool:
        got = live_probe(live, trace_at(rate), time_scale)
        p50, p99 = _percentile(got["ttft_s"], 50), _percentile(got["ttft_s"], 99)
        good = not got["failed"] and p50 <= slo[0] and p99 <= slo[1]
        probes.append({"rate": rate, "p50": p50, "p99": p99, "met": good, **got})
        return good

    return bisect_capacity(ok, lo=lo, hi=hi, tol=tol, max_rate=max_rate), probes


def run_live(base: DeploymentConfig, trace, segments: dict, *, cache: bool, block_tokens: int,
             capacity_blocks: int, time_scale: float, workdir: Path,
             decode_runs: int = 0) -> dict:
    """One live run of ``trace`` (Ray already started); TTFTs in paper seconds."""
    with live_cluster(base, segments, cache=cache, block_tokens=block_tokens,
                      capacity_blocks=capacity_blocks, time_scale=time_scale,
                      workdir=workdir, decode_runs=decode_runs) as live:
        got = live_probe(live, trace, time_scale)
    return {"cache": cache, **got, "startup_s": live.startup_s}
