"""SIMULATION: prefix caching on a shared-prefix workload, TTFT and capacity with the cache on
and off, side by side in one run, on the paper's cluster.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefix_cache.py [--model 8b] [--seed 0]
        [--rates 0.5,1,1.5] [--documents 100] [--sessions 50] [--json]

The workload (tetris/sim/prefix_workload.py): documents of 32k-128k tokens with 4-8 questions
each, multi-turn sessions of 3-6 turns, 8 streams active at once, 512-token blocks. Both runs
plan with the same policy and fixed θ; the cached run's index holds half of the prefill pool's
KV memory in blocks. Capacity: the highest rate whose TTFT P50 and P99 stay within 25x those
of the uncached run at 0.25 req/s (the simulator's capacity rule, one SLO for both).
"""

from __future__ import annotations

import argparse
import json

import msgspec

from tetris.sim.prefix_experiments import (
    prefix_capacity,
    run_prefix,
    slo_from_light_load,
)
from tetris.sim.prefix_workload import PrefixWorkload, shared_prefix_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="8b")
    ap.add_argument("--policy", default="tetris")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rates", default="0.5,1,1.5")
    ap.add_argument("--documents", type=int, default=100)
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--no-capacity", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    spec = PrefixWorkload(documents=args.documents, sessions=args.sessions)
    run = {"model": args.model, "policy": args.policy}
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        reqs = shared_prefix_workload(spec, rate, args.seed)
        off, _ = run_prefix(reqs, cache=False, rate=rate, block_tokens=spec.block_tokens, **run)
        on, _ = run_prefix(reqs, cache=True, rate=rate, block_tokens=spec.block_tokens, **run)
        rows.append({"rate": rate, "requests": len(reqs), "off": msgspec.to_builtins(off),
                     "on": msgspec.to_builtins(on)})
    cap = None
    if not args.no_capacity:
        slo = slo_from_light_load(spec, args.seed, 0.25, **run)
        c_off, _ = prefix_capacity(spec, args.seed, cache=False, slo=slo, lo=0.25, hi=1.0,
                                   tol=0.05, **run)
        c_on, _ = prefix_capacity(spec, args.seed, cache=True, slo=slo, lo=0.25, hi=1.0,
                                  tol=0.05, **run)
        cap = {"slo_p50_s": slo[0], "slo_p99_s": slo[1], "off_rps": c_off, "on_rps": c_on}
    if args.json:
        print(json.dumps({"model": args.model, "seed": args.seed, "rows": rows,
                          "capacity": cap}))
        return
    print(f"SIMULATION  model={args.model} policy={args.policy} seed={args.seed} "
          f"documents={spec.documents} sessions={spec.sessions}")
    print("| rate req/s | requests | TTFT P50 off / on (s) | ratio | TTFT P99 off / on (s) "
          "| ratio | planned from cache | tokens not computed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        off, on = r["off"], r["on"]
        print(f"| {r['rate']:g} | {r['requests']} | {off['ttft_p50']:.3f} / {on['ttft_p50']:.3f} "
              f"| {on['ttft_p50'] / off['ttft_p50']:.2f} "
              f"| {off['ttft_p99']:.3f} / {on['ttft_p99']:.3f} "
              f"| {on['ttft_p99'] / off['ttft_p99']:.2f} | {on['hit_rate']:.1%} "
              f"| {on['cached_token_share']:.1%} |")
    if cap is not None:
        print(f"capacity (TTFT P50 <= {cap['slo_p50_s']:.2f} s and P99 <= "
              f"{cap['slo_p99_s']:.2f} s): off {cap['off_rps']:.2f} req/s, on "
              f"{cap['on_rps']:.2f} req/s, ratio {cap['on_rps'] / cap['off_rps']:.2f}")


if __name__ == "__main__":
    main()
