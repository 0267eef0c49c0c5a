"""EMULATION capacity of per-chunk SP layout choice vs the ring only, beside SIMULATION (#26).

Capacity is the simulator's (``tetris.sim.experiments``): a rate is sustained when TTFT P50
<= 25·ℓ50 and P99 <= 25·ℓ99, ``ℓ`` the light-load latencies of the workload (its tail
included) on the paper cluster. Here both sides judge the same seeded trace of ``n``
requests, so the simulated capacity is searched by bisection on that trace
(``sim_capacity``) and the live one coarsely, from a few probed rates bracketing it
(``coarse_capacity``: the highest probed rate with every probe at or below it sustained and no
request failed). A short trace builds less backlog than the simulator's 1000 requests, so its
capacity is higher; the comparison is live against simulated on the same trace, not live
against the 1000-request figure.

A probe with the 1M-token tail is the same trace with every ``tail_every``-th prompt replaced
(``tetris.sim.elastic_runs.with_tail``).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tetris.bench.fidelity import _compare, scale_deployment, simulate, trace_for
from tetris.config import DeploymentConfig

__all__ = ["coarse_capacity", "layout_trace", "run_probes", "sim_capacity", "sustained"]


def layout_trace(workload: str, rate: float, n: int, seed: int, max_output: int,
                 tail_every: int = 0, tail_tokens: int = 1_000_000) -> list:
    """The seeded trace of ``fidelity.trace_for``, with the tail when ``tail_every`` > 0."""
    trace = trace_for(workload, rate, n, seed, max_output)
    if tail_every > 0:
        from tetris.sim.elastic_runs import with_tail

        trace = with_tail(trace, tail_every, tail_tokens)
    return trace


def sustained(p50: float, p99: float, light: tuple[float, float], failed: int = 0) -> bool:
    """The simulator's capacity criterion (``experiments.capacity``), and no request failed."""
    from tetris.sim.experiments import SLO_FACTOR

    return failed == 0 and p50 <= SLO_FACTOR * light[0] and p99 <= SLO_FACTOR * light[1]


def sim_capacity(cfg: DeploymentConfig, trace_at: Callable[[float], list],
                 light: tuple[float, float], *, lo: float, hi: float,
                 tol: float) -> tuple[float, list[list]]:
    """Bisection, as ``experiments.capacity``, of ``fidelity.simulate`` on ``trace_at(rate)``;
    ``hi`` is the cap (a short trace can meet the SLO at any rate). Returns the rate (0.0 when
    ``lo`` is not sustained) and the probes ``[rate, P50, P99, sustained]``."""
    probes: list[list] = []

    def ok(rate: float) -> bool:
        t = np.asarray(simulate(cfg, trace_at(rate))["ttft_s"])
        p50, p99 = float(np.percentile(t, 50)), float(np.percentile(t, 99))
        good = sustained(p50, p99, light)
        probes.append([rate, p50, p99, good])
        return good

    if not ok(lo):
        return 0.0, probes
    if ok(hi):
        return hi, probes
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, probes


def coarse_capacity(probes: Sequence[tuple[float, bool]]) -> tuple[float, float | None]:
    """``(capacity, first failing rate)`` from probed ``(rate, sustained)``: the highest rate
    below which every probe was sustained (0.0 if the lowest failed), and the lowest failing
    rate above it (None when all were sustained): the live capacity lies in between."""
    cap, first_fail = 0.0, None
    for rate, good in sorted(probes):
        if not good:
            first_fail = rate
            break
        cap = rate
    return cap, first_fail


def run_probes(base: DeploymentConfig, rates: Sequence[float], trace_at: Callable[[float], list],
               light: tuple[float, float], *, time_scale: float) -> list[dict]:
    """Live (one app for all rates) and simulated runs of ``trace_at(rate)`` at each rate, as
    ``fidelity._compare`` reports them, with whether each side sustained the rate (live: TTFT to
    the dispatcher's prefill end, the simulator's definition)."""
    from tetris.bench.fidelity_live import LiveCluster

    runs = []
    with tempfile.TemporaryDirectory(prefix="tetris-sp-layouts-") as tmp:
        live_cfg = scale_deployment(base, time_scale, Path(tmp))
        with LiveCluster(live_cfg) as live:
            for rate in sorted(rates):
                trace = trace_at(rate)
                sim = simulate(base, trace)
                got = asyncio.run(live.run_trace(trace, time_scale))
                row = _compare(rate, trace, sim, got, time_scale)
                s, e = row["sim_ttft_s"], row["live_prefill_end_ttft_s"]
                row["sim_sustained"] = sustained(s["p50"], s["p99"], light)
                row["live_sustained"] = sustained(e["p50"], e["p99"], light, row["failed"])
                row["app_startup_s"] = live.startup_s
                runs.append(row)
    return runs
