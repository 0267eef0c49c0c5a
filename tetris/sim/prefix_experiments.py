"""SIMULATION of prefix caching: one shared-prefix workload with the cache on and off.

Both runs use the paper's cluster (``CLUSTERS``), the policy with a fixed θ (no improvement-rate
table exists for this workload), and the same requests; the cached run's control plane holds
a ``PrefixIndex`` of ``capacity_blocks`` blocks, so only the index differs.

Capacity is the highest rate whose TTFT P50 and P99 stay within ``SLO_FACTOR`` times those of
the uncached run at light load (the simulator's capacity rule, ``experiments.capacity``, with
one SLO for both runs so that the two capacities compare).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from tetris.config import SpLayoutConfig
from tetris.control import ControlPlane, PrefillQueue
from tetris.control.prefix_index import PrefixIndex
from tetris.scheduler.policies import make_policy
from tetris.scheduler.prefix_move import PrefixMove
from tetris.scheduler.sp_comm import LLAMA3_8B, LLAMA3_70B, CommLinks
from tetris.sim.cluster import Simulation, cluster_by_name
from tetris.sim.experiments import SLO_FACTOR, _decode_side, _profile, execution_fn
from tetris.sim.prefix_decode import PrefixDecodeSimulation
from tetris.sim.prefix_workload import (
    PrefixWorkload,
    decode_kept_hashes,
    shared_prefix_prompts,
    shared_prefix_workload,
)
from tetris.sim.workload import SimRequest

__all__ = ["PrefixRun", "bisect_capacity", "cluster_prefix_move", "default_capacity_blocks",
           "prefix_capacity", "run_prefix", "slo_from_light_load"]


class PrefixRun(msgspec.Struct, frozen=True):
    """One run's TTFT figures, hits and the index at the end."""

    cache: bool
    rate: float
    requests: int
    ttft_p50: float
    ttft_p99: float
    ttft_mean: float
    hit_rate: float          # requests planned from a cached prefix / requests
    cached_token_share: float   # prompt tokens not computed / prompt tokens
    index: dict[str, int]
    # With simulated decode: arrival to all of the request's KV on its decode instance
    # (prefix shard included, ``prefix_transfer``), and decode-side reuse (``prefix_decode``).
    kv_ready_p50: float = float("nan")
    kv_ready_p99: float = float("nan")
    decode_reuses: int = 0
    decode_reused_tokens: int = 0
    kv_tail_mean: float = float("nan")   # mean of KV on decode - prefill end (the hand-off)
    moved_rate: float = 0.0   # requests whose cached prefix was moved to a first group / requests


def default_capacity_blocks(model: str, block_tokens: int, share: float = 0.5) -> int:
    """``share`` of the prefill pool's KV memory, in blocks (the rest is for running prefills).
    Counted as blocks of the index, not the sources' whole KV (docs/prefix_cache.md)."""
    c = cluster_by_name(model)
    tokens = c.prefill_instances * c.kv_capacity_tokens(c.prefill_tp) * share
    return int(tokens // block_tokens)


def run_prefix(requests: list[SimRequest], *, model: str = "8b", policy: str = "tetris",
               improvement_rate: float = 0.3, cache: bool, block_tokens: int = 512,
               capacity_blocks: int | None = None, decode: bool = False,
               decode_runs: int = 0, kept: dict | None = None,
               rate: float = 0.0, placement: str = "auto",
               move: bool = True) -> tuple[PrefixRun, Simulation]:
    """One run; ``decode_runs`` > 0 (with ``decode`` and ``cache``) keeps that many finished
    runs per decode instance for decode-side reuse, ``kept`` their block hashes
    (``prefix_workload.decode_kept_hashes``). ``placement`` is ``[prefix_cache] placement``;
    ``move`` offers the "move" option on the cluster's links (``cluster_prefix_move``)."""
    cluster = cluster_by_name(model)
    lat = _profile(cluster)
    pol = make_policy(policy, lat, sp_candidates=cluster.sp_candidates,
                      improvement_rate=improvement_rate)
    step, router = _decode_side(cluster) if decode else (None, None)
    index = None
    if cache:
        blocks = (default_capacity_blocks(model, block_tokens) if capacity_blocks is None
                  else capacity_blocks)
        index = PrefixIndex(block_tokens, blocks)
    control = ControlPlane(pol, PrefillQueue(cluster.node_of()), router,
                           improvement_rate=improvement_rate, prefix_index=index,
                           prefix_placement=placement,
                           prefix_move=cluster_prefix_move(cluster) if move else None)
    common = {"cluster": cluster, "control": control, "latency": lat, "decode_step": step,
              "workload": "shared-prefix", "rate": rate, "record": True,
              "execution": execution_fn(model, "profile")}
    sim = (PrefixDecodeSimulation(requests, decode_runs=decode_runs, kept=kept or {}, **common)
           if cache and decode and decode_runs else Simulation(requests, **common))
    res = sim.run()
    plans = sim.plans or []
    prompt = sum(p.prompt_tokens for p in plans)
    ready = [d.ready_time - r.arrival_time for r, d in zip(requests, sim.decode_reqs)
             if d is not None]
    p50, p99 = np.percentile(ready, [50, 99]) if ready else (float("nan"),) * 2
    tails = [d.ready_time - d.first_token_time for d in sim.decode_reqs if d is not None]
    tail = float(np.mean(tails)) if tails else float("nan")
    kept_stats = sim.kept.stats() if isinstance(sim, PrefixDecodeSimulation) else {}
    return PrefixRun(cache, rate, res.requests, res.ttft.p50, res.ttft.p99, res.ttft.mean,
                     sum(1 for p in plans if p.cached_tokens) / max(1, len(plans)),
                     sum(p.cached_tokens for p in plans) / max(1, prompt),
                     index.stats() if index is not None else {}, float(p50), float(p99),
                     kept_stats.get("decode_reuses", 0),
                     kept_stats.get("decode_reused_tokens", 0), tail,
                     sum(1 for p in plans if p.cached_moved) / max(1, len(plans))), sim


def cluster_prefix_move(cluster) -> PrefixMove:
    """The link model a cached prefix's move is priced on: the cluster's model per prefill
    instance (the paper's LLaMA3 geometry, ``experiments._layout_policy``'s) and the default
    ``[sp_layout]`` links (the paper's NVSwitch and one 200 Gb/s NIC per GPU)."""
    full = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}[cluster.model]
    return PrefixMove(full.per_instance(cluster.prefill_tp), CommLinks.from_config(SpLayoutConfig()))


def bisect_capacity(ok: Callable[[float], bool], *, lo: float, hi: float, tol: float,
                    max_rate: float = 64.0) -> float:
    """The highest rate ``ok`` accepts (``experiments.capacity``'s search): 0 when ``lo``
    fails; the bracket doubles from ``hi`` while it passes, up to ``max_rate``, which is
    returned when it passes too (a finite trace may meet a loose SLO at any rate); then
    bisection to ``tol``. Shared by the SIMULATION and the EMULATION searches."""
    if not ok(lo):
        return 0.0
    while ok(hi):
        if hi >= max_rate:
            return hi
        lo, hi = hi, min(hi * 2, max_rate)
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def prefix_capacity(spec: PrefixWorkload, seed: int, *, cache: bool, slo: tuple[float, float],
                    lo: float, hi: float, tol: float, max_rate: float = 64.0,
                    **run: Any) -> tuple[float, list]:
    """Bisection for the highest rate meeting ``slo`` = (P50, P99) bounds; ``lo`` must meet
    it (else 0). Returns the rate and the probes (rate, P50, P99, met)."""
    probes = []

    def ok(rate: float) -> bool:
        items = shared_prefix_prompts(spec, rate, seed)
        kept = decode_kept_hashes(items, spec.block_tokens) if run.get("decode_runs") else None
        r, _ = run_prefix([r for r, _ in items], cache=cache, rate=rate,
                          block_tokens=spec.block_tokens, kept=kept, **run)
        good = r.ttft_p50 <= slo[0] and r.ttft_p99 <= slo[1]
        probes.append((rate, r.ttft_p50, r.ttft_p99, good))
        return good

    return bisect_capacity(ok, lo=lo, hi=hi, tol=tol, max_rate=max_rate), probes


def slo_from_light_load(spec: PrefixWorkload, seed: int, rate: float,
                        factor: float = SLO_FACTOR, **run: Any) -> tuple[float, float]:
    """``factor`` (``SLO_FACTOR``) × the uncached run's TTFT P50 and P99 at a light ``rate``."""
    r, _ = run_prefix(shared_prefix_workload(spec, rate, seed), cache=False, rate=rate,
                      block_tokens=spec.block_tokens, **run)
    return factor * r.ttft_p50, factor * r.ttft_p99
