"""SIMULATION: prefix caching on a shared-prefix workload, TTFT and capacity with the cache on
and off, side by side in one run, on the paper's cluster.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefix_cache.py [--model 8b] [--seed 0]
        [--rates 0.5,1,1.5] [--documents 100] [--sessions 50] [--decode]
        [--decode-runs 4] [--slo-factor 25] [--max-rate 64] [--no-move] [--json]

The workload (tetris/sim/prefix_workload.py): documents of 32k-128k tokens with 4-8 questions
each, multi-turn sessions of 3-6 turns, 8 streams active at once, 512-token blocks. Both runs
plan with the same policy and fixed θ; the cached run's index holds half of the prefill pool's
KV memory in blocks. Capacity: the highest rate whose TTFT P50 and P99 stay within
``--slo-factor`` (25) times those of the uncached run at 0.25 req/s (the simulator's capacity
rule, one SLO for every setting), searched up to ``--max-rate``.

``--decode`` simulates the decode instances too: each request's KV crosses to its decode
instance (a cached prefix streamed from its holders, ``tetris/sim/prefix_transfer.py``) and
"KV on decode" is arrival to the last of it there. ``--decode-runs N`` adds a third setting,
the cache with decode-side reuse (N runs kept per decode instance, ``tetris/sim/prefix_decode.py``):
a next turn routed to the instance that kept the previous one receives only its suffix.

A hit is planned by extending the holders' group, moving the prefix's KV to a group without
them, or recomputing (the latency model's choice, ``tetris/scheduler/prefix_plan.py``);
``--no-move`` adds the setting without the move, side by side.
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
from tetris.sim.prefix_workload import (
    PrefixWorkload,
    decode_kept_hashes,
    shared_prefix_prompts,
)


def _settings(args) -> dict[str, dict]:
    """name -> run_prefix keywords of each compared setting."""
    out = {"off": {"cache": False}, "on": {"cache": True}}
    if args.decode and args.decode_runs:
        out["on+decode"] = {"cache": True, "decode_runs": args.decode_runs}
    if args.no_move:   # the cache without issue #23's move option: extend or recompute
        out["on-no-move"] = {"cache": True, "move": False}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="8b")
    ap.add_argument("--policy", default="tetris")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rates", default="0.5,1,1.5")
    ap.add_argument("--documents", type=int, default=100)
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--decode-runs", type=int, default=0)
    ap.add_argument("--slo-factor", type=float, default=25.0)
    ap.add_argument("--max-rate", type=float, default=64.0)
    ap.add_argument("--no-capacity", action="store_true")
    ap.add_argument("--no-move", action="store_true",
                    help="add the setting on-no-move: the cache whose hits only extend the "
                         "holders' group or recompute (no move of the prefix's KV)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    spec = PrefixWorkload(documents=args.documents, sessions=args.sessions)
    run = {"model": args.model, "policy": args.policy, "decode": args.decode}
    settings = _settings(args)
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        items = shared_prefix_prompts(spec, rate, args.seed)
        reqs, kept = [r for r, _ in items], decode_kept_hashes(items, spec.block_tokens)
        row = {"rate": rate, "requests": len(reqs)}
        for name, kw in settings.items():
            got, _ = run_prefix(reqs, rate=rate, block_tokens=spec.block_tokens, kept=kept,
                                **kw, **run)
            row[name] = msgspec.to_builtins(got)
        rows.append(row)
    cap = None
    if not args.no_capacity:
        slo = slo_from_light_load(spec, args.seed, 0.25, factor=args.slo_factor, **run)
        cap = {"slo_factor": args.slo_factor, "slo_p50_s": slo[0], "slo_p99_s": slo[1],
               "max_rate": args.max_rate}
        for name, kw in settings.items():
            cap[name], _ = prefix_capacity(spec, args.seed, slo=slo, lo=0.25, hi=1.0, tol=0.05,
                                           max_rate=args.max_rate, **kw, **run)
    if args.json:
        print(json.dumps({"label": "SIMULATION", "args": vars(args), "rows": rows,
                          "capacity": cap}))
        return
    _print(args, spec, settings, rows, cap)


def _print(args, spec, settings, rows, cap) -> None:
    print(f"SIMULATION  model={args.model} policy={args.policy} seed={args.seed} "
          f"documents={spec.documents} sessions={spec.sessions} decode={args.decode}")
    names = list(settings)
    print("| rate req/s | requests | setting | TTFT P50 (s) | TTFT P99 (s) | KV on decode P50 / "
          "P99 (s) | KV after prefill, mean (ms) | planned from cache | tokens not computed "
          "| decode reuses | prefix moved |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        for name in names:
            x = r[name]
            print(f"| {r['rate']:g} | {r['requests']} | {name} | {x['ttft_p50']:.3f} "
                  f"| {x['ttft_p99']:.3f} | {x['kv_ready_p50']:.3f} / {x['kv_ready_p99']:.3f} "
                  f"| {1e3 * x['kv_tail_mean']:.1f} | {x['hit_rate']:.1%} | {x['cached_token_share']:.1%} "
                  f"| {x['decode_reuses']} | {x['moved_rate']:.1%} |")
    if cap is not None:
        caps = ", ".join(f"{n} {cap[n]:.2f} req/s" for n in names)
        print(f"capacity (TTFT P50 <= {cap['slo_p50_s']:.2f} s and P99 <= {cap['slo_p99_s']:.2f} s, "
              f"{cap['slo_factor']:g}x light load; searched up to {cap['max_rate']:g}): {caps}; "
              f"on / off {cap['on'] / cap['off']:.2f}")


if __name__ == "__main__":
    main()
