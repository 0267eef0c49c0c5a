"""Runs of elastic decode against whole-request placement (SIMULATION).

- ``run_elastic(spec, config)``: the whole cluster (``run_one``'s deployment: policy, control
  plane, prefill pool, KV transfer) with the decode side placed by ``ElasticPlacer``;
- ``run_decode_side(requests, model, config)``: the decode side alone, each request's KV
  handed off at its arrival time (as if prefill kept up), for the decode side's own limit;
- ``decode_capacity``: the highest arrival rate the decode side sustains: the P99 of the time
  a request's KV waits for room (hand-off to admission) within ``max_wait_s``.
- ``with_tail``: a workload with every ``every``-th prompt replaced by a ``tail_tokens`` one.

Both placements run through the same code (``ElasticSimulation``, ``ShardedDecodeSim``); the
config alone differs, so a pair of runs on the same requests is a side-by-side comparison.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import msgspec
import numpy as np

from tetris.control import ControlPlane, PrefillQueue
from tetris.control.elastic import ElasticConfig, ElasticPlacer, ExchangeModel
from tetris.scheduler.decode_latency import DecodeLatencyModel
from tetris.scheduler.policies import make_policy
from tetris.scheduler.router import DecodeRouter
from tetris.sim.cluster import NIC_BYTES_PER_S, ClusterSpec, cluster_by_name
from tetris.sim.elastic import ElasticSimulation, ShardedDecodeRequest
from tetris.sim.events import EventKind
from tetris.sim.experiments import (
    RunSpec,
    _profile,
    execution_fn,
    make_requests,
    prefill_policy,
)
from tetris.sim.workload import SimRequest

__all__ = ["DecodeSideResult", "decode_capacity", "exchange_model", "run_decode_side",
           "run_elastic", "with_tail"]


def exchange_model(cluster: ClusterSpec) -> ExchangeModel:
    """The q/partial exchange of ``cluster``'s decode instances (bf16, TP x 200 Gb/s NICs)."""
    spec = DecodeLatencyModel.for_model(cluster.model).model
    return ExchangeModel(num_layers=cluster.num_layers, num_heads=spec.hidden_size // cluster.head_dim,
                         num_kv_heads=cluster.kv_heads, head_dim=cluster.head_dim,
                         link_bandwidth=cluster.decode_tp * NIC_BYTES_PER_S)


def _placer(cluster: ClusterSpec, config: ElasticConfig):
    step = DecodeLatencyModel.for_model(cluster.model).step_time
    cap = cluster.kv_capacity_tokens(cluster.decode_tp)
    router = DecodeRouter([cap] * cluster.decode_instances)
    placer = ElasticPlacer(router, [cap] * cluster.decode_instances, step, cluster.decode_tp,
                           exchange_model(cluster), config)
    return placer, step


def run_elastic(spec: RunSpec, config: ElasticConfig,
                requests: list[SimRequest] | None = None):
    """``run_one(spec)`` with the decode side placed by an ``ElasticPlacer`` of ``config``."""
    cluster = cluster_by_name(spec.model)
    if requests is None:
        requests = make_requests(spec.workload, spec.rate, spec.requests, spec.seed,
                                 spec.output_mean)
    lat = _profile(cluster)
    policy, monitor = prefill_policy(spec, cluster, lat)
    placer, step = _placer(cluster, config)
    control = ControlPlane(policy, PrefillQueue(cluster.node_of()), placer.router,
                           improvement_rate=spec.improvement_rate, monitor=monitor)
    sim = ElasticSimulation(requests, placer=placer, cluster=cluster, control=control,
                            latency=lat, decode_step=step, workload=spec.workload,
                            seed=spec.seed, rate=spec.rate,
                            execution=execution_fn(spec.model, spec.execution))
    return sim.run(), sim


class _DecodeSide(ElasticSimulation):
    """The decode side alone: a request's KV is handed off at its arrival. A request that fits
    no group now waits (FIFO among such requests; the others go past it) and is placed again
    whenever a decode step ends; one that no
    placement could ever hold (whole: more than an instance) is refused, as the live
    router's DecodeFull would be."""

    def __init__(self, requests, **kw) -> None:
        super().__init__(requests, **kw)
        self.refused: list[str] = []
        self.unplaced: deque[int] = deque()
        caps = sorted((d.capacity for d in self.decoders), reverse=True)
        self.reachable = sum(caps[:self.placer.config.max_group]) if self.placer.config.enabled \
            else caps[0]

    def _on_arrival(self, now: float, i: int) -> None:
        self.ttft[i] = 0.0
        self.prefill_end[i] = now
        r = self.requests[i]
        if r.prompt_tokens + r.output_tokens > self.reachable:
            self.refused.append(r.request_id)
        elif not self._place(now, i):
            self.unplaced.append(i)

    def _place(self, now: float, i: int) -> bool:
        r = self.requests[i]
        group = self.placer.place(r.request_id, r.prompt_tokens + r.output_tokens,
                                  r.output_tokens)
        if group.tokens_on(group.master) > self.decoders[group.master].capacity:
            self.placer.finished(r.request_id)   # no group has room now: wait
            return False
        self.groups[r.request_id] = group
        req = ShardedDecodeRequest(r.request_id, i, r.prompt_tokens, r.output_tokens,
                                   r.arrival_time, group.tokens_on(group.master))
        req.remote = [(self.decoders[m], group.tokens_on(m)) for m in group.instances
                      if m != group.master]
        self.decode_reqs[i] = req
        self.events.push(now, EventKind.KV_READY, (group.master, req))
        return True

    def _kick(self, now: float, skip=None) -> None:
        while self.unplaced and self._place(now, self.unplaced[0]):
            self.unplaced.popleft()
        super()._kick(now, skip)


class DecodeSideResult(msgspec.Struct, frozen=True):
    rate: float
    requests: int
    sharded: int                 # requests placed on a group of more than one instance
    refused: int                 # requests no placement could ever hold
    consolidations: int          # ranges moved onto their master (LoongServe §1.5)
    tbt_p50: float
    tbt_p99: float
    wait_p99: float              # hand-off to admission (waiting for room), s
    tokens_per_s_per_gpu: float  # output tokens over the run / decode GPUs


def run_decode_side(requests: list[SimRequest], model: str, config: ElasticConfig,
                    rate: float = float("nan")) -> DecodeSideResult:
    cluster = cluster_by_name(model)
    placer, step = _placer(cluster, config)
    policy = make_policy("fixed-sp-8", _profile(cluster), sp_candidates=cluster.sp_candidates)
    control = ControlPlane(policy, PrefillQueue(cluster.node_of()), placer.router,
                           improvement_rate=0.0)
    sim = _DecodeSide(requests, placer=placer, cluster=cluster, control=control,
                      latency=_profile(cluster), decode_step=step)
    res = sim.run()
    reqs = [r for r in sim.decode_reqs if r is not None]
    waits = np.array([r.admit_time - r.ready_time for r in reqs if not np.isnan(r.admit_time)])
    finish = max(r.finish_time for r in reqs)
    out = sum(requests[r.index].output_tokens for r in reqs)
    gpus = cluster.decode_instances * cluster.decode_tp
    return DecodeSideResult(
        rate=rate,
        requests=len(requests), sharded=sum(len(r.remote) > 0 for r in reqs),
        refused=len(sim.refused), consolidations=sim.consolidations,
        tbt_p50=res.tbt.p50, tbt_p99=res.tbt.p99,
        wait_p99=float(np.percentile(waits, 99)) if waits.size else 0.0,
        tokens_per_s_per_gpu=out / (finish - requests[0].arrival_time) / gpus)


def with_tail(requests: Sequence[SimRequest], every: int, tail_tokens: int) -> list[SimRequest]:
    """Every ``every``-th request (the ``every-1``-th, ``2·every-1``-th, ...) gets a prompt
    of ``tail_tokens``; arrivals and outputs stay."""
    return [msgspec.structs.replace(r, prompt_tokens=tail_tokens) if (i + 1) % every == 0 else r
            for i, r in enumerate(requests)]


def decode_capacity(model: str, workload: str, config: ElasticConfig, *, n: int, seed: int,
                    every: int, tail_tokens: int, max_wait_s: float = 2.0,
                    lo: float = 0.5, hi: float = 64.0, tol: float = 0.1,
                    allow_refused: bool = False):
    """Bisection for the highest rate at which every request is served (none refused, unless
    ``allow_refused``) and the P99 wait for room of those served is within ``max_wait_s``; returns (rate, the result there,
    [(rate, wait P99, sustained)] probed). 0.0 when even ``lo`` is not sustained."""
    probes = []

    def run(rate: float) -> tuple[DecodeSideResult, bool]:
        reqs = with_tail(make_requests(workload, rate, n, seed), every, tail_tokens)
        res = run_decode_side(reqs, model, config, rate)
        ok = (allow_refused or res.refused == 0) and res.wait_p99 <= max_wait_s
        probes.append((rate, res.wait_p99, ok))
        return res, ok

    best, ok = run(lo)
    if not ok:
        return 0.0, best, probes
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        res, ok = run(mid)
        if ok:
            lo, best = mid, res
        else:
            hi = mid
    return lo, best, probes
