"""Capacity per policy when the simulated hardware runs the fit, and when it runs the measurements
(SIMULATION; docs/simulation.md, "Execution on the measurements").

The scheduler always plans with its fitted profile (Eq. 1). ``--execution profile`` executes
chunks at the fit too (plans come true exactly); ``measured`` executes them at the profile's
measurements (8B: the paper's Table 1, ``tetris.scheduler.execution``), which no policy sees. Both
are run side by side here, on the same arrivals, per seed, with the capacity definition of
``tetris.sim.experiments``. Disaggregated policies are simulated prefill-only (their TTFT
does not depend on decode); LoongServe (unified) with decode.

    OMP_NUM_THREADS=1 python benchmarks/bench_execution.py --seeds 5
    OMP_NUM_THREADS=1 python benchmarks/bench_execution.py --workloads long --seeds 5 --json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from tqdm import tqdm

from tetris.sim.experiments import RunSpec, capacity, light_load

DISAGG_BASELINES = ("fixed-sp-8", "fixed-sp-16", "loongserve-disagg")
EXECUTIONS = ("profile", "measured")


def measure(model: str, workload: str, execution: str, seeds: list[int], policies: list[str],
            requests: int, tol: float, output_mean: float) -> dict[str, dict]:
    """Capacity per policy with ``seeds`` pooled (one seed: that seed's capacity)."""
    light = light_load(model, workload, execution=execution)
    out = {}
    for policy in policies:
        spec = RunSpec(model=model, workload=workload, policy=policy, requests=requests,
                       seed=seeds[0], decode=policy == "loongserve", output_mean=output_mean,
                       execution=execution)
        c = capacity(spec, seeds, tol=tol, light=light)
        out[policy] = {"capacity_rps": c.capacity_rps, "ceiling_rps": c.ceiling_rps}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b", choices=["8b"],
                    help="only 8B has measurements (the 70B profile is derived)")
    ap.add_argument("--workloads", default="short,medium,long")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--output-mean", type=float, default=2048.0)
    ap.add_argument("--no-loongserve", action="store_true",
                    help="leave out LoongServe (unified), the one policy that simulates decode")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    baselines = list(DISAGG_BASELINES) + ([] if args.no_loongserve else ["loongserve"])
    policies = ["tetris"] + baselines
    # One row per seed, and one with every seed pooled per probe (seed "pooled"), which is how
    # `tetris sim capacity --seeds N` defines a capacity over several seeds.
    seeds = [[s] for s in range(args.seeds)] + ([list(range(args.seeds))] if args.seeds > 1 else [])
    runs = [(w, e, s) for w in workloads for e in EXECUTIONS for s in seeds]
    rows: list[dict] = []
    for w, e, s in tqdm(runs, desc="capacity", disable=args.json, file=sys.stderr):
        caps = measure(args.model, w, e, s, policies, args.requests, args.tol, args.output_mean)
        best = max(baselines, key=lambda p: caps[p]["capacity_rps"])
        rows.append({"workload": w, "execution": e, "seed": s[0] if len(s) == 1 else "pooled",
                     "capacities": caps,
                     "best_baseline": best,
                     "ratio": caps["tetris"]["capacity_rps"] / caps[best]["capacity_rps"],
                     # LoongServe (unified) shares its GPUs with decode: it has no ceiling
                     "ceiling_ratio": None if caps[best]["ceiling_rps"] is None else
                     caps["tetris"]["ceiling_rps"] / caps[best]["ceiling_rps"]})
    summary = []
    for w in workloads:
        for e in EXECUTIONS:
            sel = [r for r in rows if r["workload"] == w and r["execution"] == e
                   and r["seed"] != "pooled"]
            pooled = [r["ratio"] for r in rows if r["workload"] == w and r["execution"] == e
                      and r["seed"] == "pooled"]
            ratios = [r["ratio"] for r in sel]
            summary.append({"workload": w, "execution": e, "ratios": ratios,
                            "pooled_ratio": pooled[0] if pooled else None,
                            "mean_ratio": float(np.mean(ratios)), "min_ratio": float(min(ratios)),
                            "ceiling_ratios": sorted({r["ceiling_ratio"] for r in sel
                                                      if r["ceiling_ratio"] is not None}),
                            "mean_capacity": {p: float(np.mean([r["capacities"][p]["capacity_rps"]
                                                                for r in sel])) for p in policies},
                            "best_baselines": sorted({r["best_baseline"] for r in sel})})
    if args.json:
        print(json.dumps({"model": args.model, "requests": args.requests, "tol": args.tol,
                          "output_mean": args.output_mean, "rows": rows, "summary": summary}))
        return 0
    print(f"SIMULATION, {args.model}, {args.requests} requests per seed, tol {args.tol} req/s; "
          "capacity Tetris / best baseline per seed")
    head = " ".join(f"{p:>17s}" for p in policies)
    print(f"{'workload':8s} {'execution':9s} {head}   ratio per seed            mean   min  "
          "pooled  ceiling ratio (vs the best disaggregated baseline)")
    for x in summary:
        caps = " ".join(f"{x['mean_capacity'][p]:17.3f}" for p in policies)
        per = " ".join(f"{r:.3f}" for r in x["ratios"])
        print(f"{x['workload']:8s} {x['execution']:9s} {caps}   {per:24s}  {x['mean_ratio']:.3f} "
              f"{x['min_ratio']:.3f} {x['pooled_ratio'] or float('nan'):6.3f}  "
              f"{' '.join(f'{c:.3f}' for c in x['ceiling_ratios'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
