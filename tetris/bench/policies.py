"""``tetris bench policies``: the prefill policies compared live (emulated) and simulated.

EMULATION. For every policy (Tetris CDSP and the disaggregated baselines of SPEC §8) and every
arrival rate, one seeded trace runs through

(a) the simulator: ``tetris.bench.fidelity.simulate`` on the deployment with
    ``scheduler.policy`` replaced, and
(b) the live emulated Serve app of that same deployment (``LiveCluster``: one app per policy,
    since the dispatcher builds its policy from the config at start), requests open-loop.

The question is the paper's claim as the simulator reproduces it: does the live system rank the
policies the way the simulator does? Per rate, policies are ordered by TTFT P50 and by P99 in
each run; the orders agree when every pair the simulator separates by more than the tie
tolerance keeps its order live (pairs the simulator calls a tie are not judged: a 2% gap in 30
requests says nothing). Live TTFT adds the ingress hops and the KV hand-off to the emulated
compute; an offset common to all policies leaves the order unchanged, which is why the order
and not the absolute value is compared (``tetris bench fidelity`` measures the values).

Default rates 1, 3, 5 req/s (Short): the simulator's critical rate of the best baseline
(fixed-sp-8) on the 8B cluster is 4.34 req/s (docs/figures/capacity_8b.md), so the three are
light load (0.23×), below the knee (0.7×) and just past it (1.15×). On a 30-request trace the
simulator ranks them differently at 1 req/s (LoongServe-disagg's θ = 0 takes the largest SP
group and wins an idle pool) than at 3 and 5 (Tetris's chunks fill queue gaps and win).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from tetris.bench.fidelity import EMULATION_LABEL, _pcts, scale_deployment, simulate, trace_for
from tetris.config import DeploymentConfig, load_deployment

__all__ = ["run_policies", "policy_deployment", "order", "compare_orders", "plot",
           "DEFAULT_POLICIES", "DEFAULT_RATES", "DEFAULT_TIE", "METRICS"]

DEFAULT_POLICIES = ("tetris", "fixed-sp-8", "loongserve-disagg")
DEFAULT_RATES = (1.0, 3.0, 5.0)
# Two policies whose simulated TTFTs lie within 5% are a tie: a 30-request percentile moves
# that much when one request changes place.
DEFAULT_TIE = 0.05
METRICS = ("p50", "p99")


# -- the runs -------------------------------------------------------------------------------
def policy_deployment(base: DeploymentConfig, name: str) -> DeploymentConfig:
    """``base`` planning with policy ``name``; checked by planning one request on an idle pool,
    so that a policy that cannot run on this pool fails before any app starts."""
    from tetris.bench.fidelity import _cluster
    from tetris.scheduler.policies import PolicyError, policy_from_config
    from tetris.scheduler.pool import PoolState

    if name == "loongserve":
        raise ValueError("loongserve (unified) shares its instances between prefill and decode: "
                         "it is not a policy of a disaggregated deployment (use loongserve-disagg)")
    cfg = msgspec.structs.replace(base, scheduler=msgspec.structs.replace(base.scheduler, policy=name))
    cluster, _spec = _cluster(cfg)
    try:
        policy_from_config(cfg.scheduler).plan(
            "check", 1024, 0.0, PoolState([0.0] * cluster.prefill_instances, cluster.node_of()))
    except PolicyError as e:
        raise ValueError(f"policy {name!r} on {base.source_path}: {e}") from None
    return cfg


def run_policies(config: str | Path | None, *, policies: list[str], rates: list[float],
                 workload: str = "short", requests: int = 30, seed: int = 0,
                 time_scale: float = 10.0, max_output: int = 16, tie: float = DEFAULT_TIE,
                 live: bool = True, tick: Callable[[int], None] | None = None) -> dict:
    """Simulated (and unless ``live`` is false, live) TTFT per (policy, rate), and the orders."""
    base = load_deployment(config or "paper-llama3-8b-emulated.toml")
    if live and (base.prefill.executor != "emulated" or base.decode.executor != "emulated"):
        raise ValueError("the policy comparison needs an emulated deployment "
                         "(prefill.executor = decode.executor = \"emulated\")")
    if len(set(policies)) != len(policies) or len(set(rates)) != len(rates):
        raise ValueError(f"policies and rates must not repeat: {policies}, {rates}")
    cfgs = {name: policy_deployment(base, name) for name in policies}
    traces = {rate: trace_for(workload, rate, requests, seed, max_output) for rate in rates}
    t_start = time.perf_counter()
    results: list[dict] = []
    startup: dict[str, float] = {}
    with _one_ray(live):   # one Ray for every policy's app: each app only redeploys
        for name in policies:
            sims = {rate: simulate(cfgs[name], traces[rate]) for rate in rates}
            lives = _live_runs(cfgs[name], traces, time_scale, tick, startup, name) if live else {}
            results += [_row(name, rate, len(traces[rate]), sims[rate], lives.get(rate))
                        for rate in rates]
    orders = [_orders_at(rate, results, policies, tie) for rate in rates]
    judged = [o for o in orders if o["agree"] is not None]
    return {"emulation": live, "label": EMULATION_LABEL if live else "SIMULATION only",
            "config": base.source_path, "workload": workload, "requests": requests, "seed": seed,
            "time_scale": time_scale, "max_output_tokens": max_output, "tie_tolerance": tie,
            "policies": list(policies), "rates": list(rates), "app_startup_s": startup,
            "results": results, "orders": orders,
            "orders_agree": all(o["agree"] for o in judged) if judged else None,
            "orders_agree_p50": all(o["p50"]["agree"] for o in judged) if judged else None,
            "wall_s": time.perf_counter() - t_start}


@contextlib.contextmanager
def _one_ray(live: bool) -> Iterator[None]:
    import ray
    from ray import serve

    from tetris.bench.fidelity_live import start_ray

    if not live or ray.is_initialized():
        yield
        return
    start_ray()
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def _live_runs(cfg: DeploymentConfig, traces: dict, time_scale: float, tick, startup: dict,
               name: str) -> dict[float, dict]:
    from tetris.bench.fidelity_live import LiveCluster

    out = {}
    with tempfile.TemporaryDirectory(prefix="tetris-policies-") as tmp:
        with LiveCluster(scale_deployment(cfg, time_scale, Path(tmp))) as cluster:
            startup[name] = cluster.startup_s
            for rate, trace in traces.items():
                got = asyncio.run(cluster.run_trace(trace, time_scale, tick=tick))
                got["plans"] = plan_shapes(got.pop("timelines"))
                out[rate] = got
    return out


def plan_shapes(timelines: list[dict]) -> dict:
    """What the live dispatcher planned: chunks per request and the SP sizes of the chunks."""
    sizes = [tuple(t["sp_sizes"]) for t in timelines]
    flat = [s for ss in sizes for s in ss]
    counts: dict[str, int] = {}
    for s in sorted(flat):
        counts[str(s)] = counts.get(str(s), 0) + 1
    return {"requests": len(sizes),
            "chunks_mean": sum(map(len, sizes)) / len(sizes) if sizes else math.nan,
            "chunks_max": max(map(len, sizes), default=0),
            "sp_mean": sum(flat) / len(flat) if flat else math.nan,
            "sp_size_chunks": counts,
            "sp_sizes": [list(ss) for ss in sizes]}


def _row(policy: str, rate: float, n: int, sim: dict, live: dict | None) -> dict:
    row = {"policy": policy, "rate": rate, "requests": n, "sim_ttft_s": _pcts(sim["ttft_s"])}
    if live is not None:
        row |= {"live_ttft_s": _pcts(live["ttft_s"]),
                "live_prefill_end_ttft_s": _pcts(live["prefill_ttft_s"]),
                "failed": live["failed"], "errors": live["errors"], "live_plans": live["plans"],
                "arrival_lag_ms_p99": _p99_ms(live["lag_s"])}
    return row


def _p99_ms(xs: list[float]) -> float:
    import numpy as np

    return float(np.percentile(xs, 99) * 1e3) if xs else 0.0


# -- orders ---------------------------------------------------------------------------------
def order(values: dict[str, float]) -> list[str]:
    """Names from the lowest value up (ties by name); NaN (no measurement) last."""
    return sorted(values, key=lambda k: (math.isnan(values[k]), values[k], k))


def compare_orders(sim: dict[str, float], live: dict[str, float], tie: float = DEFAULT_TIE) -> dict:
    """Whether ``live`` ranks every pair the way ``sim`` does, pairs within ``tie`` (relative)
    of each other in ``sim`` excepted. A NaN on either side is a disagreement: a policy whose
    requests failed has no rank."""
    if sorted(sim) != sorted(live):
        raise ValueError(f"different policies: {sorted(sim)} vs {sorted(live)}")
    discordant, ties = [], []
    for a, b in itertools.combinations(sorted(sim), 2):
        sa, sb, la, lb = sim[a], sim[b], live[a], live[b]
        if any(math.isnan(x) for x in (sa, sb, la, lb)):
            discordant.append([a, b])
        elif abs(sa - sb) <= tie * min(sa, sb):
            ties.append([a, b])
        elif (sa < sb) != (la < lb):
            discordant.append([a, b])
    return {"sim": order(sim), "live": order(live), "agree": not discordant,
            "discordant": discordant, "sim_ties": ties}


def _orders_at(rate: float, results: list[dict], policies: list[str], tie: float) -> dict:
    rows = {r["policy"]: r for r in results if r["rate"] == rate}
    out: dict = {"rate": rate}
    for m in METRICS:
        sim = {p: rows[p]["sim_ttft_s"][m] for p in policies}
        if "live_ttft_s" in rows[policies[0]]:
            out[m] = compare_orders(sim, {p: rows[p]["live_ttft_s"][m] for p in policies}, tie)
        else:
            out[m] = compare_orders(sim, sim, tie) | {"live": [], "agree": None}
    out["agree"] = None if out["p50"]["agree"] is None else out["p50"]["agree"] and out["p99"]["agree"]
    return out


# -- plot -----------------------------------------------------------------------------------
def plot(out: dict, path: str | Path) -> None:
    """TTFT P50 and P99 against rate, one colour per policy; solid live, dashed simulator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    colours = plt.get_cmap("tab10")
    for ax, m in zip(axes, METRICS):
        for i, name in enumerate(out["policies"]):
            rows = sorted((r for r in out["results"] if r["policy"] == name), key=lambda r: r["rate"])
            rates = [r["rate"] for r in rows]
            ax.plot(rates, [r["sim_ttft_s"][m] for r in rows], "--", color=colours(i),
                    marker="x", label=f"{name} (sim)")
            if all("live_ttft_s" in r for r in rows):
                ax.plot(rates, [r["live_ttft_s"][m] for r in rows], "-", color=colours(i),
                        marker="o", label=f"{name} (live)")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"TTFT {m.upper()} (s)")
        ax.set_title(f"TTFT {m.upper()}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    what = "EMULATION" if out["emulation"] else "SIMULATION"
    fig.suptitle(f"{what}: {out['workload']} workload, {out['requests']} requests per point, "
                 f"time scale {out['time_scale']:g}", fontsize=10)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
