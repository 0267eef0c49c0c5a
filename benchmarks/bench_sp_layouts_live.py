"""EMULATION beside SIMULATION: per-chunk SP layout choice vs the ring only, live.

The paper's 8B cluster emulated (``configs/paper-llama3-8b-emulated.toml``: 16 TP-1 prefill
workers on 2 virtual nodes of 8, 2 emulated TP-8 decode instances, A100 profile, fixed θ) runs
one seeded Long trace per rate through the live Ray Serve app once per ``[sp_layout]``
setting, and the simulator runs the same trace on the same deployment
(``tetris.bench.fidelity.run_fidelity``). An emulated worker waits Eq. 1 plus the plan's
layout delta for a non-ring chunk, as the simulator charges it. ``--time-scale s`` slows all
emulated time (the chooser's links included) by ``s``; live times are divided by ``s``.

    OMP_NUM_THREADS=1 python benchmarks/bench_sp_layouts_live.py --rates 0.5,1 --requests 30 \\
        --time-scale 2 [--json out.json]

The load average of this machine is printed beside each run: a shared machine slows the live
control plane, not the emulated chunk times.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import msgspec

from tetris.bench.fidelity import run_fidelity
from tetris.config import SpLayoutConfig, load_deployment

SETTINGS = {
    "ring only": SpLayoutConfig(),
    "ring|a2a": SpLayoutConfig(layouts=("ring", "a2a")),
    "ring|a2a, ring charged in full": SpLayoutConfig(layouts=("ring", "a2a"), ring_overlap=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="paper-llama3-8b-emulated.toml")
    ap.add_argument("--workload", default="long")
    ap.add_argument("--rates", default="0.5,1.0")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--max-output", type=int, default=4)
    ap.add_argument("--settings", default=";".join(SETTINGS),
                    help="which [sp_layout] settings, by name, separated by ;")
    ap.add_argument("--json", default=None, help="write every run's raw result here")
    args = ap.parse_args()
    base = load_deployment(args.config)
    rates = [float(r) for r in args.rates.split(",")]
    print(f"EMULATION vs SIMULATION, {args.config}, {args.workload}, {args.requests} requests "
          f"per rate, seed {args.seed}, time scale {args.time_scale:g}")
    out = {}
    for name in args.settings.split(";"):
        cfg = msgspec.structs.replace(base, sp_layout=SETTINGS[name])
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        res = run_fidelity(cfg, workload=args.workload, rates=rates, requests=args.requests,
                           seed=args.seed, time_scale=args.time_scale, max_output=args.max_output)
        res["load_average_1m"] = [load0, os.getloadavg()[0]]
        out[name] = res
        for r in res["runs"]:
            sim, live = r["sim_ttft_s"], r["live_prefill_end_ttft_s"]
            print(f"{name}: {r['rate']:g} req/s: SIMULATION P50 {sim['p50']:.3f} s P99 "
                  f"{sim['p99']:.3f} s | EMULATION (prefill end) P50 {live['p50']:.3f} s P99 "
                  f"{live['p99']:.3f} s (first token P50 {r['live_ttft_s']['p50']:.3f} s P99 "
                  f"{r['live_ttft_s']['p99']:.3f} s); failed {r['failed']}; same plan "
                  f"{r['per_request']['same_plan']}/{r['requests']}")
        print(f"{name}: wall {time.perf_counter() - t0:.0f} s, load average (1 min) "
              f"{load0:.1f} before, {os.getloadavg()[0]:.1f} after")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
