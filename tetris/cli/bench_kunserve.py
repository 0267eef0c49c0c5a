"""``tetris bench kunserve``: KunServe vs queue / recompute / swap on a BurstGPT-like burst,
SIMULATION and (with ``--emulated``) EMULATION side by side; the benchmark is
``tetris.bench.kunserve_compare``."""

from __future__ import annotations

import argparse

from tetris.cli.args import positive_float, positive_int

__all__ = ["add_args", "run", "show"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="qwen2.5-14b-tp1",
                   help="configs/kunserve-<profile>.toml (default: 8 x Qwen-2.5-14B TP-1)")
    p.add_argument("--requests", type=positive_int, default=10000)
    p.add_argument("--rate", type=positive_float, default=150.0,
                   help="base arrivals/s; the middle 40%% of the requests arrive at twice it")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--emulated", action="store_true",
                   help="also run the EMULATION (emulated engines on the wall clock, about "
                        "the trace's duration times --time-scale per policy)")
    p.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="slow emulated time by this factor (the machine cannot keep up)")
    p.add_argument("--jobs", type=positive_int, default=3,
                   help="emulated policies run at once, one process each (default 3)")
    p.add_argument("--instances", type=positive_int, default=None,
                   help="override the profile's decode instances (a shorter run)")
    p.add_argument("--kv-scale", type=positive_float, default=1.0,
                   help="fraction of each instance's KV region kept (a shorter run)")


def run(args: argparse.Namespace) -> dict:
    from tetris.bench.kunserve_compare import compare

    return compare(profile=args.profile, requests=args.requests, rate=args.rate, seed=args.seed,
                   time_scale=args.time_scale, jobs=args.jobs, instances=args.instances,
                   kv_scale=args.kv_scale, emulate=args.emulated)


def show(out: dict) -> None:
    print(f"profile={out['profile']} instances={out['instances']} kv_blocks={out['kv_blocks']} "
          f"requests={out['requests']} rate={out['rate']:g}/s -> {2 * out['rate']:g}/s "
          f"seed={out['seed']} time_scale={out['time_scale']:g}")
    print(f"{'mode':<10} {'policy':<10} {'P50 TTFT':>9} {'P99 TTFT':>9} {'P99/Kun':>8} "
          f"{'P50 TPOT':>9} {'Kun/this':>9} {'preempt':>8} {'drops':>6} {'restores':>8} "
          f"{'exch GB':>8} {'unfin':>6}")
    for mode in ("SIMULATION", "EMULATION"):
        rows = out[mode]
        if not rows:
            continue
        k = rows["kunserve"]
        for policy, r in rows.items():
            print(f"{mode:<10} {policy:<10} {r['p50_ttft']:>9.3f} {r['p99_ttft']:>9.3f} "
                  f"{r['p99_ttft'] / k['p99_ttft']:>7.1f}x {r['p50_tpot'] * 1e3:>7.1f}ms "
                  f"{k['p50_tpot'] / r['p50_tpot']:>8.3f}x {r['preemptions']:>8} {r['drops']:>6} "
                  f"{r['restores']:>8} {r['exchange_gb']:>8.1f} {r['unfinished']:>6}")
    emu, sim = out["EMULATION"], out["SIMULATION"]
    for policy in emu:
        e, s = emu[policy], sim[policy]
        print(f"live/sim {policy:<10} P99 TTFT {e['p99_ttft'] / s['p99_ttft']:.3f}  "
              f"P50 TTFT {e['p50_ttft'] / s['p50_ttft']:.3f}  "
              f"P50 TPOT {e['p50_tpot'] / s['p50_tpot']:.3f}  (EMULATION / SIMULATION)")
