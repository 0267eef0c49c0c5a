"""Simulator speed: simulated requests per second of wall time, per policy, side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_sim.py [--requests 2000] [--rate 4] [--json]

Prefill-only runs are what the improvement-rate profiler and the capacity search execute;
runs with decode add the continuous-batching iterations of the decode instances.
"""

from __future__ import annotations

import argparse
import json

from tetris.sim.experiments import RunSpec, run_one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--workload", default="short")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for policy in ("tetris", "tetris-single-chunk", "loongserve-disagg", "fixed-sp-8", "loongserve"):
        for decode in (False, True):
            if policy == "loongserve" and not decode:
                continue  # LoongServe's prefill depends on its decode reservations
            spec = RunSpec(policy=policy, workload=args.workload, rate=args.rate,
                           requests=args.requests, decode=decode,
                           improvement_rate=0.35 if policy.startswith("tetris") else None)
            res, _ = run_one(spec)
            rows.append({"policy": policy, "decode": decode, "wall_s": res.sim_wall_s,
                         "sim_requests_per_s": res.sim_requests_per_s})
    if args.json:
        print(json.dumps({"requests": args.requests, "rate": args.rate, "rows": rows}))
        return
    for r in rows:
        print(f"{r['policy']:22s} decode={str(r['decode']):5s} {r['wall_s']:7.2f}s "
              f"{r['sim_requests_per_s']:9.0f} simulated req/s")


if __name__ == "__main__":
    main()
