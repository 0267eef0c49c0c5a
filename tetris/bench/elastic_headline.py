"""Elastic decode's headline: elastic vs whole-request decode placement, SIMULATION beside
EMULATION (issue #25).

One seeded trace (the Long workload, every ``tail_every``-th prompt replaced by a
``tail_tokens`` one) runs per rate and per placement

(a) simulated: ``ElasticSimulation`` (the control plane's ``ElasticPlacer`` on its router) on
    the emulated deployment's cluster: the prefill profile, the decode latency model of its
    model, its decode instances at its ``kv_blocks`` (SIMULATION);
(b) live: the emulated deployment's Ray Serve app with ``[decode] elastic`` on or off, requests
    sent open-loop through the ingress handle, every streamed token timed at the caller
    (EMULATION: no model runs, times come from the A100 latency models).

Both placements run as the served path places: a group only when no single instance has room
(``spread_for_time`` off), and no consolidation (the served path moves no range; the
simulated run can be asked to, ``consolidate``). Whole placement refuses a request no instance
can hold (``DecodeFull``, a 429) before any prefill; so does elastic placement beyond the sum.

TBT: the time between a request's consecutive tokens. Live, a streamed delta of ``k`` tokens
after a gap ``g`` counts ``k`` gaps of ``g / k``; simulated, each decode step of a batch of
``b`` counts ``b`` times (``Simulation._tbt``). Times are in paper seconds (live wall time
divided by the time scale).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np

from tetris.bench.fidelity import _cluster, _pcts, scale_deployment, trace_for
from tetris.bench.fidelity_live import LiveCluster
from tetris.config import DeploymentConfig

__all__ = ["TimedLiveCluster", "elastic_trace", "placement", "simulate_placement"]

SIM_LABEL = "SIMULATION"
EMU_LABEL = "EMULATION: no model runs; times come from the A100 latency models"


def placement(cfg: DeploymentConfig, elastic: bool, kv_tokens: int | None = None,
              max_len: int | None = None) -> DeploymentConfig:
    """``cfg`` with ``[decode] elastic`` set and, given ``kv_tokens``, each decode instance
    holding that many KV tokens (``kv_blocks`` of ``block_size``); ``max_len`` raises the
    model's context limit (the ingress refuses longer prompts; emulation has none of its own)."""
    dc = msgspec.structs.replace(cfg.decode, elastic=elastic)
    if kv_tokens is not None:
        dc = msgspec.structs.replace(dc, kv_blocks=kv_tokens // dc.block_size)
    cfg = msgspec.structs.replace(cfg, decode=dc)
    if max_len is not None and max_len > cfg.model.max_position_embeddings:
        cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(
            cfg.model, max_position_embeddings=max_len))
    return cfg


def elastic_trace(workload: str, rate: float, n: int, seed: int, max_output: int,
                  tail_every: int, tail_tokens: int):
    from tetris.sim.elastic_runs import with_tail

    return with_tail(trace_for(workload, rate, n, seed, max_output), tail_every, tail_tokens)


def simulate_placement(cfg: DeploymentConfig, requests, consolidate: bool = False) -> dict:
    """SIMULATION of ``cfg`` (its ``[decode] elastic`` decides the placement) on ``requests``."""
    from tetris.control import ControlPlane, PrefillQueue
    from tetris.control.elastic import ElasticConfig, ElasticPlacer, ExchangeModel
    from tetris.scheduler.decode_latency import DecodeLatencyModel
    from tetris.scheduler.latency import load_profile
    from tetris.scheduler.policies import make_policy
    from tetris.scheduler.router import DecodeRouter
    from tetris.sim.cluster import NIC_BYTES_PER_S
    from tetris.sim.elastic import ElasticSimulation

    cluster, spec = _cluster(cfg)
    sc, dc, mc = cfg.scheduler, cfg.decode, cfg.model
    latency = load_profile(sc.profile or "a100-llama3-8b-tp1")
    policy = make_policy(sc.policy, latency, sp_candidates=sc.sp_candidates or None,
                         min_chunk_tokens=sc.min_chunk_tokens,
                         improvement_rate=sc.improvement_rate)
    capacity = dc.kv_blocks * dc.block_size
    step = DecodeLatencyModel(spec).step_time
    router = DecodeRouter([capacity] * dc.num_instances)
    exchange = ExchangeModel(num_layers=mc.num_layers, num_heads=mc.num_heads,
                             num_kv_heads=mc.num_kv_heads, head_dim=mc.attention_head_dim,
                             link_bandwidth=dc.tp_size * NIC_BYTES_PER_S)
    placer = ElasticPlacer(router, [capacity] * dc.num_instances, step, dc.tp_size, exchange,
                           ElasticConfig(enabled=dc.elastic, max_group=dc.num_instances,
                                         spread_for_time=False))
    control = ControlPlane(policy, PrefillQueue(cluster.node_of()), router,
                           improvement_rate=sc.improvement_rate)
    sim = ElasticSimulation(list(requests), placer=placer, kv_capacity=capacity,
                            consolidate=consolidate, cluster=cluster, control=control,
                            latency=latency, decode_step=step)
    res = sim.run()
    tbt = res.tbt
    return {"label": SIM_LABEL, "ttft_s": _pcts(res.ttft_s),
            "tbt_s": {"p50": tbt.p50, "p99": tbt.p99, "mean": tbt.mean} if tbt else None,
            "refused": len(sim.refused), "served": len(requests) - len(sim.refused),
            "sharded": sum(g.sharded for g in sim.groups.values()),
            "consolidations": sim.consolidations}


class TimedLiveCluster(LiveCluster):
    """``LiveCluster`` whose client times every streamed token."""

    async def send_one(self, r, request_id: str) -> dict:
        from tetris.sampling_params import SamplingParams
        from tetris.serve.types import GenerationRequest

        sent = time.perf_counter()
        req = GenerationRequest(prompt_token_ids=self.prompt_of(r), request_id=request_id,
                                sampling=SamplingParams(max_tokens=r.output_tokens,
                                                        temperature=0, ignore_eos=True))
        deltas, err = [], None
        try:
            async for d in self.ingress.options(stream=True).generate_stream.remote(req):
                if d.new_token_ids:
                    deltas.append((time.perf_counter(), len(d.new_token_ids)))
        except Exception as e:  # noqa: BLE001 - a refused or failed request is counted
            err = f"{type(e).__name__}: {e}"
        tokens = sum(k for _, k in deltas)
        if err is None and tokens < r.output_tokens:
            err = f"{tokens} of {r.output_tokens} tokens"
        return {"request_id": request_id, "sent": sent, "deltas": deltas, "error": err}

    async def run_placement(self, trace, time_scale: float) -> dict:
        """The trace open-loop at its arrival times (× ``time_scale``); paper seconds out."""
        t0 = time.perf_counter() + 0.05

        async def one(r):
            await asyncio.sleep(max(0.0, t0 + r.arrival_time * time_scale - time.perf_counter()))
            return await self.send_one(r, f"el-{r.request_id}-{int(t0 * 1e3)}")

        out = await asyncio.gather(*[one(r) for r in trace])
        ttft, gaps, weights = [], [], []
        for o in out:
            if o["error"] is None and o["deltas"]:
                ttft.append((o["deltas"][0][0] - o["sent"]) / time_scale)
                prev = o["deltas"][0][0]
                for t, k in o["deltas"][1:]:
                    gaps.append((t - prev) / time_scale / k)
                    weights.append(k)
                    prev = t
        errors = [o["error"] for o in out if o["error"]]
        return {"label": EMU_LABEL, "ttft_s": _pcts(ttft), "tbt_s": _weighted(gaps, weights),
                "served": len(out) - len(errors), "refused": sum(_refusal(e) for e in errors),
                "failed": len(errors), "errors": sorted(set(errors))[:5]}


def _refusal(error: str) -> bool:
    """The reservation's refusal (``DecodeFull`` as ``Overloaded``: a 429 over HTTP)."""
    return "no KV room" in error or "DecodeFull" in error


def _weighted(values, weights) -> dict:
    from tetris.sim.metrics import weighted_percentiles

    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    v, w = np.asarray(values), np.asarray(weights, dtype=float)
    p50, p99 = weighted_percentiles(v, w, [50, 99])
    return {"p50": p50, "p99": p99, "mean": float((v * w).sum() / w.sum())}


def run_live(cfg: DeploymentConfig, traces: dict[float, list], time_scale: float,
             workdir) -> dict:
    """EMULATION of ``cfg`` on each rate's trace, one app for all rates; {rate: result}."""
    live_cfg = scale_deployment(cfg, time_scale, workdir)
    out = {}
    with TimedLiveCluster(live_cfg, app_name="elastic") as live:
        out["app_startup_s"] = live.startup_s
        for rate, trace in traces.items():
            t0 = time.perf_counter()
            out[rate] = asyncio.run(live.run_placement(trace, time_scale))
            out[rate]["wall_s"] = time.perf_counter() - t0
            out[rate]["held_after"] = live.held()
    return out
