"""EMULATION capacity (coarse) and TTFT of per-chunk SP layout choice vs the ring only, beside SIMULATION.

The emulated paper 8B cluster (``configs/paper-llama3-8b-emulated.toml``, A100 profile, fixed θ)
runs one seeded Long trace of ``--requests`` requests at each probed rate, once per
``[sp_layout]`` setting (``tetris.bench.sp_layouts_live.run_probes``); the simulator runs the
same trace on the same deployment. A rate is sustained under the simulator's capacity SLO (TTFT
P50 <= 25·ℓ50, P99 <= 25·ℓ99, ℓ the light-load latencies of ``experiments.light_load`` on the
paper cluster, tail included). Per setting: the simulated capacity on this trace (bisection),
each probe's P50/P99 on both sides with its verdict, and the live capacity bracket.

    OMP_NUM_THREADS=1 python benchmarks/bench_sp_layouts_live_capacity.py --requests 120 \\
        --rates 4.25,4.9,5.5 --time-scale 3 [--json out.json]
    # the 1M-token tail: one 1M prompt (request 12 of 20) at 0.2 req/s (the model's position
    # limit is raised to fit it: emulated workers have none)
    OMP_NUM_THREADS=1 python benchmarks/bench_sp_layouts_live_capacity.py --requests 20 \\
        --rates 0.2 --tail 1000000 --tail-every 12 --time-scale 1 --sim-lo 0.05

EMULATION (live) and SIMULATION are labelled in the output; the load average is printed beside
each setting (a loaded machine slows the live control plane, not the emulated chunk times).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import msgspec

from tetris.bench.sp_layouts_live import (
    coarse_capacity,
    layout_trace,
    run_probes,
    sim_capacity,
)
from tetris.config import SpLayoutConfig, load_deployment
from tetris.sim.experiments import SLO_FACTOR, light_load

SETTINGS = {
    "ring only": SpLayoutConfig(),
    "ring|a2a": SpLayoutConfig(layouts=("ring", "a2a")),
    "ring|a2a, ring charged in full": SpLayoutConfig(layouts=("ring", "a2a"), ring_overlap=False),
}


def one_setting(name: str, cfg, args, light, rates) -> dict:
    def trace_at(rate: float) -> list:
        return layout_trace(args.workload, rate, args.requests, args.seed, args.max_output,
                            args.tail_every if args.tail else 0, args.tail)

    cap, sim_probes = sim_capacity(cfg, trace_at, light, lo=args.sim_lo, hi=args.sim_hi,
                                   tol=args.sim_tol)
    print(f"{name}: SIMULATION capacity on this trace {cap:.3f} req/s "
          f"(bisection {args.sim_lo:g}..{args.sim_hi:g}, tolerance {args.sim_tol:g})")
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    runs = run_probes(cfg, rates, trace_at, light, time_scale=args.time_scale)
    for r in runs:
        s, e = r["sim_ttft_s"], r["live_prefill_end_ttft_s"]
        print(f"{name}: {r['rate']:g} req/s: SIMULATION P50 {s['p50']:.3f} P99 {s['p99']:.3f} s "
              f"{'sustained' if r['sim_sustained'] else 'NOT sustained'} | EMULATION P50 "
              f"{e['p50']:.3f} P99 {e['p99']:.3f} s "
              f"{'sustained' if r['live_sustained'] else 'NOT sustained'}; failed {r['failed']}; "
              f"same plan {r['per_request']['same_plan']}/{r['requests']}")
    live_cap, live_fail = coarse_capacity([(r["rate"], r["live_sustained"]) for r in runs])
    probed_sim = coarse_capacity([(r["rate"], r["sim_sustained"]) for r in runs])
    print(f"{name}: EMULATION capacity >= {live_cap:g} req/s"
          + (f", < {live_fail:g}" if live_fail is not None else " (every probe sustained)")
          + f"; SIMULATION at the same probes >= {probed_sim[0]:g}"
          + (f", < {probed_sim[1]:g}" if probed_sim[1] is not None else "")
          + f"; wall {time.perf_counter() - t0:.0f} s, load average (1 min) {load0:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    return {"sim_capacity_rps": cap, "sim_probes": sim_probes, "live_capacity_rps": live_cap,
            "live_first_failing_rps": live_fail, "runs": runs,
            "load_average_1m": [load0, os.getloadavg()[0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="paper-llama3-8b-emulated.toml")
    ap.add_argument("--workload", default="long")
    ap.add_argument("--rates", default="4.25,4.9,5.5", help="live probe rates (req/s)")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=3.0)
    ap.add_argument("--max-output", type=int, default=4)
    ap.add_argument("--tail", type=int, default=0, help="tokens of the tail prompts (0: none)")
    ap.add_argument("--tail-every", type=int, default=50)
    ap.add_argument("--sim-lo", type=float, default=0.25)
    ap.add_argument("--sim-hi", type=float, default=16.0)
    ap.add_argument("--sim-tol", type=float, default=0.05)
    ap.add_argument("--settings", default="ring only;ring|a2a, ring charged in full",
                    help="[sp_layout] settings by name, separated by ;")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = load_deployment(args.config)
    rates = sorted(float(r) for r in args.rates.split(","))
    tail = {"tail_every": args.tail_every, "tail_tokens": args.tail} if args.tail else {}
    light = light_load("8b", args.workload, **tail)
    label = args.workload + (f" + every {args.tail_every}th prompt {args.tail} tokens" if tail else "")
    print(f"EMULATION vs SIMULATION, {args.config}, {label}, {args.requests} requests, seed "
          f"{args.seed}, time scale {args.time_scale:g}; SLO {SLO_FACTOR:g}x light load "
          f"(P50 {light[0]:.3f} s, P99 {light[1]:.3f} s); EMULATION TTFT to prefill end")
    out = {"label": "EMULATION beside SIMULATION", "args": vars(args), "light_load_s": light,
           "slo_factor": SLO_FACTOR, "settings": {}}
    if args.tail + args.max_output > base.model.max_position_embeddings:
        # emulated workers have no positional limit; the ingress would refuse the tail prompt
        base = msgspec.structs.replace(base, model=msgspec.structs.replace(
            base.model, max_position_embeddings=args.tail + args.max_output))
    for name in args.settings.split(";"):
        cfg = msgspec.structs.replace(base, sp_layout=SETTINGS[name])
        out["settings"][name] = one_setting(name, cfg, args, light, rates)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
