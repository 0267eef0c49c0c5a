"""``tetris bench fidelity``: the emulated live system against the simulator, same seeded trace.

EMULATION. One seeded trace (Poisson arrivals at each rate, prompt lengths of a Short/Medium/
Long spec or a trace file) runs

(a) live: the Ray Serve app (``tetris.serve.app.build_app``) of an emulated deployment
    (``configs/paper-llama3-8b-emulated.toml``), requests sent open-loop at their arrival times
    through the handle API; TTFT is the time to the first streamed token at the caller;
(b) simulated: ``tetris.sim.cluster.Simulation`` with the same cluster, policy, θ, prefill
    profile and decode latency model; its TTFT is the end of the request's prefill.

A time scale ``s`` slows all emulated time uniformly (prefill profile × s, transfer bandwidth
÷ s, decode steps × s, arrival gaps × s) when the machine cannot keep up at paper speed; live
times are divided by ``s`` before they are compared, so the control plane's own cost counts
1/s as much as it would at paper speed. The output says which ``s`` was used.

Control-plane cost per request: the policy's decision time (measured around every ``plan``
call of the simulated run: the same code the dispatcher runs), the dispatcher's time from
arrival to a committed plan (routing with the decode reservation, planning, commit), the
hand-off (last chunk done to first token out: KV tail, admission, first decode round), and Ray
calls: the dispatcher's calls to the pools, two per chunk member (prepare, execute), decode
rounds and transfer control calls counted on the decode ranks.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from tetris.config import DeploymentConfig, load_deployment

__all__ = ["run_fidelity", "scale_deployment", "simulate", "trace_for"]

# Dispatcher -> pools per request: decode reserve, prefill commit, prefill run, decode commit,
# decode stream, prefill release (the handle API adds ingress -> dispatcher: one streaming call).
DISPATCH_CALLS = 6
EMULATION_LABEL = "EMULATION: no model runs; times come from the A100 latency models"


def scale_deployment(cfg: DeploymentConfig, time_scale: float, workdir: Path) -> DeploymentConfig:
    """The deployment slowed uniformly by ``time_scale`` (1: unchanged)."""
    if time_scale <= 0:
        raise ValueError(f"time scale must be positive, got {time_scale}")
    if time_scale == 1.0:
        return cfg
    from tetris.scheduler.latency import load_profile

    sc, tc, pc = cfg.scheduler, cfg.transfer, cfg.prefill
    if sc.rate_table:
        raise ValueError("a time-scaled run needs a fixed improvement rate (no rate_table): the "
                         "live rate monitor would see the scaled arrival rate")
    profile = load_profile(sc.profile or "a100-llama3-8b-tp1")
    path = workdir / f"profile-x{time_scale:g}.json"
    profile.scaled(name=f"{profile.name}-x{time_scale:g}", linear=time_scale,
                   attention=time_scale, overhead=time_scale).save(path)
    if pc.emulated_measurements is not None:
        # scaled alike, so that the workers' measured/fit ratio stays what it was
        from tetris.scheduler.execution import write_scaled_table

        table = write_scaled_table(pc.emulated_measurements, time_scale,
                                   workdir / f"measurements-x{time_scale:g}.csv")
        pc = msgspec.structs.replace(pc, emulated_measurements=str(table))
    # the layout chooser's links slowed alike: a chunk's layout delta scales with its Eq. 1 time
    lay = cfg.sp_layout
    lay = msgspec.structs.replace(lay, intra_node_gbps=lay.intra_node_gbps / time_scale,
                                  inter_node_gbps=lay.inter_node_gbps / time_scale,
                                  fit_intra_node_gbps=lay.fit_intra_node_gbps / time_scale,
                                  fit_inter_node_gbps=lay.fit_inter_node_gbps / time_scale,
                                  message_latency_s=lay.message_latency_s * time_scale)
    out = msgspec.structs.replace(
        cfg, prefill=pc, sp_layout=lay, scheduler=msgspec.structs.replace(sc, profile=str(path)),
        transfer=msgspec.structs.replace(
            tc, emulated_link_bandwidth=tc.emulated_link_bandwidth / time_scale,
            timeout_s=tc.timeout_s * time_scale))
    if hasattr(out, "emulation"):
        out = msgspec.structs.replace(out, emulation=msgspec.structs.replace(
            out.emulation, time_scale=time_scale))
    return out


def trace_for(workload: str, rate: float, n: int, seed: int, max_output: int):
    """The seeded requests: a workload spec name or a trace file (rescaled to ``rate``)."""
    from tetris.sim.workload import WORKLOADS, load_trace, poisson_workload, scale_to_rate

    if workload in WORKLOADS:
        reqs = poisson_workload(WORKLOADS[workload], rate, n, seed)
    else:
        reqs = load_trace(workload)[:n]
        reqs = scale_to_rate(reqs, rate) if len(reqs) > 1 else reqs
    # Outputs are capped for both runs: streaming every token through Serve costs this
    # machine's CPU, while TTFT does not depend on what follows the first token.
    return [msgspec.structs.replace(r, output_tokens=min(r.output_tokens, max_output)) for r in reqs]


def _cluster(cfg: DeploymentConfig):
    from tetris.actors.decode.emulated import decode_model_spec
    from tetris.sim.cluster import ClusterSpec

    m, pc, dc = cfg.model, cfg.prefill, cfg.decode
    spec = decode_model_spec(m)
    return ClusterSpec(m.name, cfg.scheduler.profile or "a100-llama3-8b-tp1", m.num_layers,
                       m.num_kv_heads, m.attention_head_dim, spec.weight_bytes / 2e9,
                       pc.num_instances, pc.node_size, pc.tp_size, dc.num_instances, dc.tp_size,
                       tuple(cfg.scheduler.sp_candidates), dc.max_batch_size), spec


class _TimedPolicy:
    """The policy, with the wall time of every ``plan`` call recorded (decision cost), and the
    last plan of every request (its SP sizes and estimate, to set beside the live plan)."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.name = getattr(policy, "name", "?")
        self.seconds: list[float] = []
        self.plans: dict[str, object] = {}

    def plan(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.policy.plan(*args, **kwargs)
        self.seconds.append(time.perf_counter() - t0)
        self.plans[out.request_id] = out
        return out


def simulate(cfg: DeploymentConfig, requests) -> dict:
    """The simulator on the deployment's cluster: TTFT per request and the decision times."""
    from tetris.scheduler.decode_latency import DecodeLatencyModel
    from tetris.scheduler.latency import load_profile
    from tetris.scheduler.layout_policy import with_layout_choice
    from tetris.scheduler.policies import make_policy
    from tetris.control import ControlPlane, PrefillQueue
    from tetris.scheduler.router import DecodeRouter
    from tetris.sim.cluster import Simulation

    cluster, spec = _cluster(cfg)
    sc, dc = cfg.scheduler, cfg.decode
    latency = load_profile(sc.profile or "a100-llama3-8b-tp1")
    policy = _TimedPolicy(with_layout_choice(   # the deployment's [sp_layout], as the dispatcher
        make_policy(sc.policy, latency, sp_candidates=sc.sp_candidates or None,
                    min_chunk_tokens=sc.min_chunk_tokens, improvement_rate=sc.improvement_rate),
        cfg))
    capacity = dc.kv_blocks * dc.block_size
    # the hardware the emulated workers stand for: the profile, or its measurements
    execution = None
    if cfg.prefill.emulated_measurements is not None:
        from tetris.scheduler.execution import execution_latency

        execution = execution_latency("measured", latency, cfg.prefill.emulated_measurements)
    control = ControlPlane(policy, PrefillQueue(cluster.node_of()),
                           DecodeRouter([capacity] * dc.num_instances),
                           improvement_rate=sc.improvement_rate)
    sim = Simulation(list(requests), cluster=cluster, control=control, execution=execution,
                     latency=latency, decode_step=DecodeLatencyModel(spec).step_time)
    res = sim.run()
    plans = {rid: {"sp_sizes": [len(c.instances) for c in p.chunks],
                   "ttft_estimate_s": p.ttft_estimate} for rid, p in policy.plans.items()}
    return {"ttft_s": list(res.ttft_s), "decision_s": policy.seconds,
            "plans": [plans.get(r.request_id) for r in requests]}


def _pcts(xs) -> dict:
    v = np.asarray([x for x in xs if x == x], dtype=float)
    if v.size == 0:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    return {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
            "mean": float(v.mean())}


def run_fidelity(config: str | Path | DeploymentConfig | None, *, workload: str = "short", rates: list[float],
                 requests: int = 40, seed: int = 0, time_scale: float = 1.0, max_output: int = 16,
                 tick: Callable[[int], None] | None = None) -> dict:
    """Both runs at every rate; one dict (JSON-ready) with the comparison per rate."""
    from tetris.bench.fidelity_live import LiveCluster

    base = (config if isinstance(config, DeploymentConfig)
            else load_deployment(config or "paper-llama3-8b-emulated.toml"))
    if base.prefill.executor != "emulated" or base.decode.executor != "emulated":
        raise ValueError("the fidelity benchmark needs an emulated deployment "
                         "(prefill.executor = decode.executor = \"emulated\")")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tetris-fidelity-") as tmp:
        live_cfg = scale_deployment(base, time_scale, Path(tmp))
        runs = []
        with LiveCluster(live_cfg) as live:
            startup_s = live.startup_s
            for rate in rates:
                trace = trace_for(workload, rate, requests, seed, max_output)
                sim = simulate(base, trace)
                got = asyncio.run(live.run_trace(trace, time_scale, tick=tick))
                runs.append(_compare(rate, trace, sim, got, time_scale))
    return {"emulation": True, "label": EMULATION_LABEL, "config": base.source_path,
            "workload": workload, "requests": requests, "seed": seed, "time_scale": time_scale,
            "max_output_tokens": max_output, "app_startup_s": startup_s, "runs": runs,
            "wall_s": time.perf_counter() - t_start}


def _per_request(trace, sim: dict, live: dict, time_scale: float) -> dict:
    """Request by request, in trace order: simulated and live TTFT (live: to the dispatcher's
    prefill end, the simulator's definition) and both plans' SP sizes and estimates (paper s).
    ``same_plan`` requests differ only in execution; the others in what the policy saw."""
    rows = []
    for i, r in enumerate(trace):
        t, p = live["timelines_by_index"].get(i), sim["plans"][i]
        rows.append({
            "arrival_s": r.arrival_time, "prompt_tokens": r.prompt_tokens,
            "sim_ttft_s": sim["ttft_s"][i], "sim_sp_sizes": p["sp_sizes"] if p else None,
            "sim_estimate_s": p["ttft_estimate_s"] if p else None,
            "live_ttft_s": None if t is None else (t["prefill_end"] - t["arrival"]) / time_scale,
            "live_queue_s": None if t is None else (t["prefill_start"] - t["arrival"]) / time_scale,
            "live_sp_sizes": None if t is None else list(t["sp_sizes"]),
            "live_estimate_s": None if t is None else t["ttft_estimate"] / time_scale})
    same = [x for x in rows if x["live_ttft_s"] is not None and x["live_sp_sizes"] == x["sim_sp_sizes"]]
    other = [x for x in rows if x["live_ttft_s"] is not None and x["live_sp_sizes"] != x["sim_sp_sizes"]]

    def gap(xs):
        return float(np.mean([x["live_ttft_s"] - x["sim_ttft_s"] for x in xs])) if xs else float("nan")

    return {"same_plan": len(same), "other_plan": len(other), "mean_gap_same_plan_s": gap(same),
            "mean_gap_other_plan_s": gap(other), "rows": rows}


def _compare(rate: float, trace, sim: dict, live: dict, time_scale: float) -> dict:
    sim_ttft, live_ttft = _pcts(sim["ttft_s"]), _pcts(live["ttft_s"])
    pre = _pcts(live["prefill_ttft_s"])
    n = len(trace)
    chunk_calls = live["chunk_member_calls"]
    decision = np.asarray(sim["decision_s"]) * 1e6
    return {
        "rate": rate, "requests": n, "failed": live["failed"],
        "sim_ttft_s": sim_ttft, "live_ttft_s": live_ttft, "live_prefill_end_ttft_s": pre,
        "ratio_p50": live_ttft["p50"] / sim_ttft["p50"], "ratio_p99": live_ttft["p99"] / sim_ttft["p99"],
        "prefill_end_ratio_p50": pre["p50"] / sim_ttft["p50"],
        "prefill_end_ratio_p99": pre["p99"] / sim_ttft["p99"],
        "within_10pct": bool(abs(live_ttft["p50"] / sim_ttft["p50"] - 1) <= 0.1
                             and abs(live_ttft["p99"] / sim_ttft["p99"] - 1) <= 0.1),
        "per_request": _per_request(trace, sim, live, time_scale),
        "control_plane": {
            "decision_us_mean": float(decision.mean()), "decision_us_p99": float(np.percentile(decision, 99)),
            "arrival_to_plan_ms": _pcts(np.asarray(live["to_plan_s"]) * 1e3 / time_scale),
            "handoff_ms": _pcts(np.asarray(live["handoff_s"]) * 1e3 / time_scale),
            "prefill_overrun_ms": _pcts(np.asarray(live.get("overrun_s", [])) * 1e3 / time_scale),
            "ray_calls_per_request": {
                "dispatcher_to_pools": DISPATCH_CALLS,
                "prefill_chunk_members": chunk_calls / n,
                "transfer_control": live["transfer_calls"] / n,
                "decode_rounds_per_rank": live["decode_steps"] / n,
            },
            "transfer_messages_per_request": {k: v / n for k, v in sorted(live["messages"].items())},
            "arrival_lag_ms_p99": float(np.percentile(live["lag_s"], 99) * 1e3) if live["lag_s"] else 0.0,
        },
    }
