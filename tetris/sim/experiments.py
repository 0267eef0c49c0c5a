"""Experiments: a single run, a rate sweep and a capacity search (paper §7.2).

Capacity (our exact definition, docs/simulation.md): for a (model, workload) the light-load
latencies ``ℓ50``/``ℓ99`` are the P50/P99, over the workload's requests, of each request's
TTFT on an idle pool (``min_s T_s(0, L)`` over the SP candidates; policy-independent). A policy
sustains rate ``r`` when, over ``requests`` Poisson arrivals per seed and the given seeds
pooled, TTFT P50 <= 25·ℓ50 and TTFT P99 <= 25·ℓ99. Its capacity is the highest such rate,
found by bisection to ``tol`` req/s (the same requests at every rate: only time is scaled).

``RunSpec.execution`` is what the simulated hardware takes per chunk (``tetris.scheduler.execution``):
``"profile"``, the scheduler's own fit, or ``"measured"``, the profile's measurements. The
light-load latencies and throughput ceilings are properties of the hardware, so they follow it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import msgspec
import numpy as np

from tetris.config import SpLayoutConfig
from tetris.scheduler.execution import LatencyFn, execution_latency
from tetris.scheduler.latency import PrefillLatencyModel, load_profile
from tetris.scheduler.layout_policy import needs_layout_choice
from tetris.scheduler.policies import make_policy
from tetris.control import ControlPlane, PrefillQueue
from tetris.scheduler.decode_latency import DecodeLatencyModel
from tetris.scheduler.rate import ImprovementRateTable, RateMonitor
from tetris.scheduler.router import DecodeRouter
from tetris.sim.cluster import ClusterSpec, Simulation, cluster_by_name
from tetris.sim.metrics import SimResult
from tetris.sim.workload import (OUTPUT_LENGTHS, SimRequest, WORKLOADS, load_trace,
                                 output_lengths, poisson_workload, scale_to_rate)

__all__ = ["RunSpec", "execution_fn", "make_requests", "run_one", "sweep", "light_load", "capacity",
           "Capacity", "SLO_FACTOR", "rate_table_path", "BASELINES", "throughput_ceiling",
           "policy_sp_sizes"]

SLO_FACTOR = 25.0
BASELINES = ("fixed-sp-8", "fixed-sp-16", "loongserve-disagg", "loongserve")
RATES_DIR = Path(__file__).resolve().parents[2] / "configs" / "rates"


class RunSpec(msgspec.Struct, frozen=True):
    """One simulated run. ``improvement_rate = None`` means online θ from ``rate_table``."""

    model: str = "8b"
    workload: str = "short"            # short | medium | long | path to a CSV/JSONL trace
    policy: str = "tetris"
    rate: float = 2.0
    requests: int = 1000
    seed: int = 0
    improvement_rate: float | None = None
    rate_table: str | None = None      # default: configs/rates/a100-llama3-<model>-<workload>.toml
    decode: bool = True
    record: bool = False
    min_chunk_tokens: int = 256
    rate_window_s: float = 60.0
    rate_update_interval_s: float = 30.0
    rate_min_arrivals: int = 100       # RateMonitor.min_arrivals: a sparse window (70B) stretches
    output_mean: float = OUTPUT_LENGTHS.mean_tokens   # mean output tokens (named workloads only)
    execution: str = "profile"         # chunk times on the simulated hardware: profile | measured
    sp_layout: SpLayoutConfig = SpLayoutConfig()   # per-chunk layout choice (scheduler/sp_comm.py)
    tail_every: int = 0                # > 0: every tail_every-th prompt has tail_tokens (elastic_runs.with_tail)
    tail_tokens: int = 1_000_000


def rate_table_path(model: str, workload: str) -> Path:
    return RATES_DIR / f"a100-llama3-{model}-{Path(workload).stem}.toml"


def make_requests(workload: str, rate: float, n: int, seed: int,
                  output_mean: float = OUTPUT_LENGTHS.mean_tokens) -> list[SimRequest]:
    """Poisson arrivals over a named distribution (outputs of mean ``output_mean``), or the
    first ``n`` rows of a trace at ``rate`` (its own output lengths)."""
    if workload in WORKLOADS:
        return poisson_workload(WORKLOADS[workload], rate, n, seed, output_lengths(output_mean))
    reqs = load_trace(workload)[:n]
    return scale_to_rate(reqs, rate) if len(reqs) > 1 else reqs


def _profile(cluster: ClusterSpec) -> PrefillLatencyModel:
    return load_profile(cluster.profile)


_EXECUTION: dict[tuple[str, str], LatencyFn] = {}


def execution_fn(model: str, execution: str = "profile") -> LatencyFn:
    """``(sp, h, l) -> seconds`` on the simulated hardware of ``model``'s cluster (cached)."""
    key = (model, execution)
    if key not in _EXECUTION:
        cluster = cluster_by_name(model)
        _EXECUTION[key] = execution_latency(execution, _profile(cluster), cluster.measurements)
    return _EXECUTION[key]


def _online_monitor(spec: RunSpec):
    path = Path(spec.rate_table) if spec.rate_table else rate_table_path(spec.model, spec.workload)
    if not path.is_file():
        raise ValueError(f"no improvement-rate table at {path}; run `tetris sim profile-rate "
                         f"--model {spec.model} --workload {spec.workload}` or pass a fixed θ")
    # The simulated clock starts at 0: the rate's span counts from there, not the first arrival.
    return RateMonitor(spec.rate_window_s, spec.rate_update_interval_s,
                       ImprovementRateTable.load(path), start_time=0.0,
                       min_arrivals=spec.rate_min_arrivals)


def prefill_policy(spec: RunSpec, cluster: ClusterSpec, lat: PrefillLatencyModel):
    """The run's prefill policy on ``lat`` and its θ monitor (None: θ fixed at
    ``spec.improvement_rate``, or the policy takes none)."""
    theta = spec.improvement_rate
    monitor = _online_monitor(spec) if spec.policy == "tetris" and theta is None else None
    policy = make_policy(spec.policy, lat, sp_candidates=cluster.sp_candidates,
                         min_chunk_tokens=spec.min_chunk_tokens,
                         improvement_rate=0.3 if theta is None else theta)
    return policy, monitor


def _decode_side(cluster: ClusterSpec):
    router = DecodeRouter([cluster.kv_capacity_tokens(cluster.decode_tp)]
                          * cluster.decode_instances)
    return DecodeLatencyModel.for_model(cluster.model).step_time, router


def run_one(spec: RunSpec, requests: list[SimRequest] | None = None,
            **simulation: Any) -> tuple[SimResult, Simulation]:
    """One run; ``simulation``: ``Simulation``'s ``stalls`` and ``pool_view``."""
    cluster = cluster_by_name(spec.model)
    if requests is None:
        requests = make_requests(spec.workload, spec.rate, spec.requests, spec.seed,
                                 spec.output_mean)
        if spec.tail_every > 0:
            from tetris.sim.elastic_runs import with_tail  # it imports this module

            requests = with_tail(requests, spec.tail_every, spec.tail_tokens)
    if spec.policy == "loongserve":
        if simulation:
            raise ValueError(f"the loongserve simulation takes no {sorted(simulation)}")
        from tetris.sim.loongserve import run_loongserve
        return run_loongserve(spec, cluster, requests, execution_fn(spec.model, spec.execution))
    lat = _profile(cluster)
    policy, monitor = prefill_policy(spec, cluster, lat)
    if needs_layout_choice(spec.sp_layout):   # another layout, pieces or links
        policy = _layout_policy(policy, spec.sp_layout, cluster, lat)
    step, router = _decode_side(cluster) if spec.decode else (None, None)
    control = ControlPlane(policy, PrefillQueue(cluster.node_of()), router,
                           improvement_rate=spec.improvement_rate, monitor=monitor)
    sim = Simulation(requests, cluster=cluster, control=control, latency=lat, decode_step=step,
                     record=spec.record, workload=spec.workload, seed=spec.seed, rate=spec.rate,
                     execution=execution_fn(spec.model, spec.execution), **simulation)
    return sim.run(), sim


def _layout_policy(policy, cfg: SpLayoutConfig, cluster: ClusterSpec, lat: PrefillLatencyModel):
    """Plans with each chunk's cheapest SP layout (CSPS Appendix A costs over ``cfg``'s links);
    the simulated chunk then takes Eq. 1 plus that layout's delta."""
    from tetris.scheduler.layout_policy import LayoutPolicy
    from tetris.scheduler.sp_comm import LLAMA3_8B, LLAMA3_70B, LayoutChooser

    full = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}[cluster.model]
    return LayoutPolicy(policy, LayoutChooser.from_config(
        cfg, full.per_instance(cluster.prefill_tp)), lat)


def sweep(base: RunSpec, policies: Sequence[str], rates: Sequence[float],
          seeds: Sequence[int] = (0,), progress=None) -> list[dict]:
    """TTFT (and TBT) per policy and rate; seeds pooled per point."""
    rows = []
    for policy in policies:
        for rate in rates:
            rows.append(_pooled(msgspec.structs.replace(base, policy=policy, rate=rate), seeds))
            if progress is not None:
                progress.update(1)
    return rows


def _pooled(spec: RunSpec, seeds: Iterable[int]) -> dict:
    ttfts, results = [], []
    for seed in seeds:
        res, _ = run_one(msgspec.structs.replace(spec, seed=seed))
        ttfts.extend(res.ttft_s)
        results.append(res)
    t = np.asarray(ttfts)
    row = {"policy": spec.policy, "rate": spec.rate, "seeds": len(results),
           "ttft_p50": float(np.percentile(t, 50)), "ttft_p90": float(np.percentile(t, 90)),
           "ttft_p99": float(np.percentile(t, 99)), "ttft_mean": float(t.mean()),
           "throughput_rps": float(np.mean([r.throughput_rps for r in results])),
           "prefill_utilisation": float(np.mean([r.prefill_utilisation for r in results])),
           "mean_chunks": float(np.mean([r.mean_chunks for r in results])),
           "mean_sp": float(np.mean([r.mean_sp for r in results])),
           "sim_requests_per_s": float(sum(r.requests for r in results)
                                       / sum(r.sim_wall_s for r in results))}
    if results[0].tbt is not None:
        row["tbt_p50"] = float(np.mean([r.tbt.p50 for r in results]))
        row["tbt_p99"] = float(np.mean([r.tbt.p99 for r in results]))
    row["_ttfts"] = ttfts
    return row


def light_load(model: str, workload: str, n: int = 2000, seed: int = 0,
               execution: str = "profile", tail_every: int = 0,
               tail_tokens: int = 1_000_000) -> tuple[float, float]:
    """``ℓ50, ℓ99``: percentiles of each request's TTFT alone on an idle pool (the workload
    with its tail when ``tail_every`` > 0, as ``RunSpec`` builds it)."""
    cluster = cluster_by_name(model)
    run = execution_fn(model, execution)
    reqs = make_requests(workload, 1.0, n, seed)
    if tail_every > 0:
        from tetris.sim.elastic_runs import with_tail

        reqs = with_tail(reqs, tail_every, tail_tokens)
    sizes = [s for s in cluster.sp_candidates if s <= cluster.prefill_instances]
    alone = np.array([min(run(s, 0, r.prompt_tokens) for s in sizes) for r in reqs])
    return float(np.percentile(alone, 50)), float(np.percentile(alone, 99))


def policy_sp_sizes(model: str, policy: str) -> tuple[int, ...] | None:
    """SP sizes a disaggregated policy may run a request on; None for LoongServe (unified),
    whose prefill pool shrinks and grows with decoding."""
    if policy == "loongserve":
        return None
    if policy.startswith("fixed-sp-"):
        return (int(policy.removeprefix("fixed-sp-")),)
    cluster = cluster_by_name(model)
    return tuple(s for s in cluster.sp_candidates if s <= cluster.prefill_instances)


def throughput_ceiling(model: str, workload: str, sizes: Sequence[int], n: int = 20000,
                       seed: int = 0, execution: str = "profile") -> float:
    """The arrival rate (req/s) at which the prefill pool is busy all the time even if every
    request ran at its most efficient size in ``sizes``: ``instances / E[min_s s·T_s(0, L)]``.

    Above it the backlog grows without bound under any schedule, so a capacity measured over
    a finite run can exceed it only by the backlog the 25x criterion tolerates; the ratio of
    two policies' ceilings bounds their capacity ratio in the long run.
    """
    cluster = cluster_by_name(model)
    lat = _profile(cluster)
    if not sizes or any(s > cluster.prefill_instances or s not in lat.table for s in sizes):
        raise ValueError(f"SP sizes {list(sizes)} do not fit the {model} pool "
                         f"({cluster.prefill_instances} instances, profile {list(lat.sp_sizes)})")
    lengths = np.array([r.prompt_tokens for r in make_requests(workload, 1.0, n, seed)], float)
    run = None if execution == "profile" else execution_fn(model, execution)
    per_size = []
    for s in sizes:
        if run is None:
            a, b, _, d = lat.table[s]
            t = a + lengths * (b + d * lengths)      # Eq. 1 with h = 0, vectorised
        else:
            t = np.array([run(s, 0, int(n_tok)) for n_tok in lengths])
        per_size.append(s * t)   # times the s instances the ring holds
    return cluster.prefill_instances / float(np.min(per_size, axis=0).mean())


class Capacity(msgspec.Struct):
    policy: str
    capacity_rps: float
    light_p50: float
    light_p99: float
    probes: list[tuple[float, float, float, bool]]   # (rate, P50, P99, sustained)
    ceiling_rps: float | None = None   # throughput_ceiling over the policy's SP sizes


def capacity(base: RunSpec, seeds: Sequence[int] = (0,), lo: float = 0.25, hi: float = 16.0,
             tol: float = 0.05, light: tuple[float, float] | None = None) -> Capacity:
    """Bisection for the highest sustainable rate (module docstring); ``lo`` must be sustainable."""
    l50, l99 = light or light_load(base.model, base.workload, execution=base.execution)
    probes = []

    def ok(rate: float) -> bool:
        row = _pooled(msgspec.structs.replace(base, rate=rate), seeds)
        good = row["ttft_p50"] <= SLO_FACTOR * l50 and row["ttft_p99"] <= SLO_FACTOR * l99
        probes.append((rate, row["ttft_p50"], row["ttft_p99"], good))
        return good

    sizes = policy_sp_sizes(base.model, base.policy) if base.workload in WORKLOADS else None
    ceiling = None if sizes is None else throughput_ceiling(base.model, base.workload, sizes,
                                                            execution=base.execution)
    if not ok(lo):
        return Capacity(base.policy, 0.0, l50, l99, probes, ceiling)
    while ok(hi):  # grow the bracket until it fails
        lo, hi = hi, hi * 2
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return Capacity(base.policy, lo, l50, l99, probes, ceiling)
