"""SIMULATION: KunServe against the KV-centric baselines on a BurstGPT-like burst.

    python benchmarks/bench_kunserve.py [--profile qwen2.5-14b-tp1] [--requests 10000]
        [--rate 150] [--seed 1]

Every policy runs the same seeded trace (rate doubles for the middle 40% of the requests) on
the same deployment profile (configs/kunserve-<profile>.toml); one table, ratios side by side.
"""

from __future__ import annotations

import argparse
import time

from tetris.sim.kunserve import POLICIES, KunServeSim
from tetris.sim.kunserve_workload import burst_trace, load_profile, profile_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="qwen2.5-14b-tp1")
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--rate", type=float, default=150.0, help="base arrivals/s (burst: 2x)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    mem, prof = load_profile(profile_path(args.profile))
    print(f"SIMULATION  profile={prof.name}  instances={prof.instances}  "
          f"params={mem.param_bytes / 1e9:.1f} GB  KV={mem.kv_bytes / 1e9:.1f} GB "
          f"({mem.kv_blocks} blocks) per instance  requests={args.requests}  "
          f"rate={args.rate:g}/s -> {2 * args.rate:g}/s  seed={args.seed}")
    rows = {}
    for policy in POLICIES:
        t0 = time.perf_counter()
        trace = burst_trace(args.requests, args.rate, seed=args.seed, burst_at=0.3,
                            burst_end=0.7)
        rows[policy] = KunServeSim(trace, mem, prof, policy).run()
        rows[policy]["wall_s"] = time.perf_counter() - t0
    k = rows["kunserve"]
    print(f"{'policy':<10} {'P50 TTFT':>9} {'P99 TTFT':>9} {'P99/Kun':>8} {'P50 TPOT':>9} "
          f"{'Kun/this':>9} {'P99 TPOT':>9} {'preempt':>8} {'drops':>6} {'restores':>8} "
          f"{'exch GB':>8} {'unfin':>6}")
    for policy, r in rows.items():
        print(f"{policy:<10} {r['p50_ttft']:>9.3f} {r['p99_ttft']:>9.3f} "
              f"{r['p99_ttft'] / k['p99_ttft']:>7.1f}x {r['p50_tpot'] * 1e3:>7.1f}ms "
              f"{k['p50_tpot'] / r['p50_tpot']:>8.3f}x {r['p99_tpot'] * 1e3:>7.1f}ms "
              f"{r['preemptions']:>8} {r['drops']:>6} {r['restores']:>8} "
              f"{r['exchange_gb']:>8.1f} {r['unfinished']:>6}")


if __name__ == "__main__":
    main()
