"""Reproductions of the paper's simulated results (§7.2): capacity table, Figs. 8, 9, 11-13.

Per workload: (1) capacity of every policy (experiments.capacity); (2) at the best baseline's
critical rate (its capacity), TTFT P50/P99, TBT and throughput of every policy, and the TTFT
CDF (Fig. 9); (3) TTFT P50/P99 against rate (Fig. 8); (4) Tetris at fixed θ against online θ
(Figs. 11-12); (5) single-chunk against CDSP (Fig. 13). Tetris always picks θ online from the
table the profiler made for that workload. Disaggregated policies are swept prefill-only (their
TTFT does not depend on decode); LoongServe (unified) always simulates decode, which takes
instances away from its prefill.

With ``--execution measured`` every file name carries ``_measured``, so both sets can sit side
by side in one directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from tetris.sim.cluster import cluster_by_name
from tetris.sim.experiments import RunSpec, capacity, light_load, run_one, sweep
from tetris.sim.plots import plot_cdf, plot_ratio_vs_rate, plot_schedule, plot_ttft_vs_rate
from tetris.sim.workload import OUTPUT_LENGTHS

__all__ = ["reproduce", "FIXED_THETAS"]


def _baselines(model: str) -> tuple[str, ...]:
    """Fixed SP at half and all of the pool (8B: 8, 16; 70B with 8 instances: 4, 8)."""
    n = cluster_by_name(model).prefill_instances
    return (f"fixed-sp-{n // 2}", f"fixed-sp-{n}", "loongserve-disagg", "loongserve")

FIXED_THETAS = (0.1, 0.3, 0.5, 0.7)


def _execution(args) -> str:
    return getattr(args, "execution", "profile")


def _suffix(args) -> str:
    return "" if _execution(args) == "profile" else f"_{_execution(args)}"


def _label(args, workload: str) -> str:
    """What a figure's title says it shows: the model, the workload, and the hardware model."""
    hw = "" if _execution(args) == "profile" else f", {_execution(args)} execution"
    return f"{args.model}, {workload}{hw}"


def _spec(args, workload: str, policy: str, **kw) -> RunSpec:
    decode = kw.pop("decode", False) or policy == "loongserve"
    return RunSpec(model=args.model, workload=workload, policy=policy, requests=args.requests,
                   seed=args.seed, rate_table=args.rate_table, decode=decode,
                   output_mean=getattr(args, "output_mean", OUTPUT_LENGTHS.mean_tokens),
                   execution=_execution(args), **kw)


def _at_critical(args, workload: str, rate: float, seeds) -> tuple[list[dict], dict]:
    rows, ttfts = [], {}
    for policy in ("tetris",) + _baselines(args.model):
        pooled, res = [], []
        for seed in seeds:
            r, _ = run_one(msgspec.structs.replace(_spec(args, workload, policy, decode=True),
                                                   rate=rate, seed=seed))
            pooled.extend(r.ttft_s)
            res.append(r)
        t = np.asarray(pooled)
        ttfts[policy] = pooled
        rows.append({"policy": policy, "rate": rate, "ttft_p50": float(np.percentile(t, 50)),
                     "ttft_p99": float(np.percentile(t, 99)),
                     "tbt_p50": float(np.mean([x.tbt.p50 for x in res])),
                     "tbt_p99": float(np.mean([x.tbt.p99 for x in res])),
                     "throughput_rps": float(np.mean([x.throughput_rps for x in res])),
                     "sim_requests_per_s": float(sum(x.requests for x in res) / sum(x.sim_wall_s for x in res))})
    return rows, ttfts


def _one_workload(args, workload: str, out: Path, bar) -> dict:
    seeds = list(range(args.seed, args.seed + args.seeds))
    BASELINES = _baselines(args.model)
    POLICIES = ("tetris",) + BASELINES
    light = light_load(args.model, workload, execution=_execution(args))
    caps = {}
    for policy in POLICIES:
        caps[policy] = capacity(_spec(args, workload, policy), seeds, light=light)
        bar.update(1)
    best = max(BASELINES, key=lambda p: caps[p].capacity_rps)
    crit = caps[best].capacity_rps
    at_crit, ttfts = _at_critical(args, workload, crit, seeds)
    # The same comparison against the best baseline on the same disaggregated cluster (LoongServe
    # unified also prefills on the GPUs that Tetris keeps for decode).
    best_d = max((b for b in BASELINES if b != "loongserve"), key=lambda p: caps[p].capacity_rps)
    crit_d = caps[best_d].capacity_rps
    at_crit_d, ttfts_d = _at_critical(args, workload, crit_d, seeds)
    plot_cdf(ttfts_d, out / f"fig9_cdf_disagg_{args.model}_{workload}{_suffix(args)}.png",
             f"TTFT CDF at {crit_d:.2f} req/s ({_label(args, workload)})")
    bar.update(1)
    tag = f"{args.model}_{workload}{_suffix(args)}"
    plot_cdf(ttfts, out / f"fig9_cdf_{tag}.png", f"TTFT CDF at {crit:.2f} req/s ({_label(args, workload)})")
    top = max(c.capacity_rps for c in caps.values())
    rates = [round(top * f, 2) for f in (0.2, 0.4, 0.6, 0.75, 0.85, 0.95, 1.05, 1.15)]
    fig8 = sweep(_spec(args, workload, "tetris"), POLICIES, rates, seeds)
    plot_ttft_vs_rate(fig8, out / f"fig8_ttft_{tag}.png", light, f"LLaMA3-{_label(args, workload)}")
    bar.update(1)
    fixed = sweep(_spec(args, workload, "tetris"), ["tetris"], rates, seeds)
    theta_series: dict[str, list] = {}
    for theta in FIXED_THETAS:
        rows = sweep(_spec(args, workload, "tetris", improvement_rate=theta), ["tetris"], rates, seeds)
        theta_series[f"θ={theta}"] = [(r["rate"], r["ttft_mean"] / d["ttft_mean"]) for r, d in zip(rows, fixed)]
    plot_ratio_vs_rate(theta_series, out / f"fig11_theta_{tag}.png", "mean TTFT / online θ",
                       f"fixed vs online θ ({_label(args, workload)})")
    single = sweep(_spec(args, workload, "tetris-single-chunk"), ["tetris-single-chunk"], rates, seeds)
    chunk_series = {"P50 single/CDSP": [(s["rate"], s["ttft_p50"] / d["ttft_p50"]) for s, d in zip(single, fixed)],
                    "P99 single/CDSP": [(s["rate"], s["ttft_p99"] / d["ttft_p99"]) for s, d in zip(single, fixed)]}
    plot_ratio_vs_rate(chunk_series, out / f"fig13_chunking_{tag}.png", "TTFT ratio",
                       f"single-chunk vs CDSP ({_label(args, workload)})")
    bar.update(1)
    tetris = next(r for r in at_crit if r["policy"] == "tetris")
    base = next(r for r in at_crit if r["policy"] == best)
    tetris_d = next(r for r in at_crit_d if r["policy"] == "tetris")
    base_d = next(r for r in at_crit_d if r["policy"] == best_d)
    for rows in (fig8, fixed, single):
        for r in rows:
            r.pop("_ttfts", None)
    return {"workload": workload, "light_p50": light[0], "light_p99": light[1],
            "capacity": {p: c.capacity_rps for p, c in caps.items()},
            "ceiling": {p: c.ceiling_rps for p, c in caps.items()}, "best_baseline": best,
            "critical_rate": crit,
            "capacity_ratio": caps["tetris"].capacity_rps / crit if crit > 0 else float("inf"),
            "p50_ratio": base["ttft_p50"] / tetris["ttft_p50"],
            "p99_ratio": base["ttft_p99"] / tetris["ttft_p99"],
            "throughput_ratio": tetris["throughput_rps"] / base["throughput_rps"],
            "at_critical": at_crit, "best_disagg_baseline": best_d, "critical_rate_disagg": crit_d,
            "capacity_ratio_disagg": caps["tetris"].capacity_rps / crit_d if crit_d > 0 else float("inf"),
            "p50_ratio_disagg": base_d["ttft_p50"] / tetris_d["ttft_p50"],
            "p99_ratio_disagg": base_d["ttft_p99"] / tetris_d["ttft_p99"],
            "throughput_ratio_disagg": tetris_d["throughput_rps"] / base_d["throughput_rps"],
            "at_critical_disagg": at_crit_d, "fig8": fig8,
            "fig11": {k: v for k, v in theta_series.items()}, "fig13": chunk_series}


def _schedule_png(args, workload: str, rate: float, out: Path) -> str:
    res, sim = run_one(_spec(args, workload, "tetris", record=True, rate=rate))
    runs = sim.prefill.runs
    mid = runs[len(runs) // 2].start
    return str(plot_schedule(runs, len(sim.prefill.free_at), out / f"schedule_{args.model}_{workload}{_suffix(args)}.png",
                             mid, mid + 15.0, f"Tetris CDSP, LLaMA3-{_label(args, workload)}, {rate:.2f} req/s"))


def _table(model: str, results: list[dict]) -> list[str]:
    POLICIES = ("tetris",) + _baselines(model)
    lines = [f"| workload | " + " | ".join(POLICIES) + " | vs | critical rate | capacity ratio | "
             "P50 ratio | P99 ratio | throughput ratio |",
             "|" + "---|" * (len(POLICIES) + 7)]
    for r in results:
        caps = " | ".join(f"{r['capacity'][p]:.2f}" for p in POLICIES)
        pairs = [("", r["best_baseline"]), ("_disagg", r["best_disagg_baseline"])]
        if pairs[0][1] == pairs[1][1]:  # the best baseline is disaggregated: one row says it
            pairs = pairs[:1]
        for sfx, who in pairs:
            lines.append(f"| {r['workload']} | {caps} | {who} | {r['critical_rate' + sfx]:.2f} | "
                         f"{r['capacity_ratio' + sfx]:.2f}x | {r['p50_ratio' + sfx]:.2f}x | "
                         f"{r['p99_ratio' + sfx]:.2f}x | {r['throughput_ratio' + sfx]:.2f}x |")
    return lines


def reproduce(args) -> tuple[dict, list[str]]:
    out = Path(args.out or "docs/figures")
    out.mkdir(parents=True, exist_ok=True)
    workloads = [w for w in args.workloads.split(",") if w]
    results = []
    with tqdm(total=len(workloads) * (len(_baselines(args.model)) + 4), desc="figures", disable=args.json) as bar:
        for w in workloads:
            results.append(_one_workload(args, w, out, bar))
    sched = _schedule_png(args, workloads[0], results[0]["critical_rate"], out)
    table = _table(args.model, results)
    (out / f"results_{args.model}{_suffix(args)}.json").write_text(
        json.dumps(results, indent=1, default=float))
    (out / f"capacity_{args.model}{_suffix(args)}.md").write_text("\n".join(table) + "\n")
    obj = {"model": args.model, "requests": args.requests, "seeds": args.seeds,
           "execution": _execution(args),
           "output_mean": getattr(args, "output_mean", OUTPUT_LENGTHS.mean_tokens),
           "schedule_png": sched,
           "results": [{k: v for k, v in r.items() if k not in ("fig8", "fig11", "fig13")} for r in results]}
    return obj, table
