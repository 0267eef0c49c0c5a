"""``tetris bench chaos``: its options, run and printout (the benchmark is ``tetris.bench.chaos``)."""

from __future__ import annotations

import argparse
import contextlib
import sys

from tetris.bench.chaos import plot_chaos, run_chaos
from tetris.cli.args import add_load_args, positive_float

__all__ = ["add_args", "run", "show"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_load_args(p, load=0.5, duration=180.0)
    p.add_argument("--kill-every", type=positive_float, default=30.0,
                   help="wall seconds between kills (30)")
    p.add_argument("--targets", default="prefill,decode",
                   help="what to kill, in turn: prefill, decode or both (prefill,decode)")
    p.add_argument("--client-retries", type=int, default=10,
                   help="times a client sends a request again after a 429 (10)")
    p.add_argument("--baseline", action="store_true",
                   help="first run the same arrivals without faults, for TTFT side by side")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write TTFT per request over the run, kills marked, here")


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    kinds = tuple(k.strip() for k in args.targets.split(",") if k.strip())
    runs = 2 if args.baseline else 1
    # Ray's driver prints raylet warnings on stdout; --json must print one object there only.
    with contextlib.redirect_stdout(sys.stderr), tqdm(
            total=int(args.duration) * runs, desc="bench chaos (EMULATION)", unit="s",
            disable=args.json, file=sys.stderr) as bar:
        try:
            out = run_chaos(args.config, workload=args.workload, capacity=args.capacity,
                            load=args.load, duration_s=args.duration, kill_every_s=args.kill_every,
                            kinds=kinds, time_scale=args.time_scale, max_output=args.max_output,
                            max_inflight=args.max_inflight, drain_timeout_s=args.drain_timeout,
                            client_retries=args.client_retries, seed=args.seed,
                            baseline=args.baseline, capacity_requests=args.capacity_requests,
                            tick=bar.update)
        except ValueError as e:
            raise SystemExit(f"tetris bench chaos: {e}") from None
    if args.plot:
        out["plot"] = str(plot_chaos(out, args.plot))
    return out


def show(out: dict) -> None:
    cap, v = out["capacity"], out["verdict"]
    print(f"{out['label']}; time scale {out['time_scale']:g}, {out['workload']} workload")
    print(f"capacity {cap['capacity_rps']:.2f} req/s ({cap['source']}), load {out['load']:g}: "
          f"{out['rate_rps']:.2f} req/s, {out['duration_s']:g} s, a kill every "
          f"{out['kill_every_s']:g} s")
    for name, r in out["runs"].items():
        print(f"{name}: sent {r['sent']}, completed {r['completed']}, failed {r['failed']}"
              + (f" ({'; '.join(r['errors'])})" if r["errors"] else "")
              + f"; TTFT P50 {r['ttft_s']['p50']:.3f} s, P99 {r['ttft_s']['p99']:.3f} s")
        if "after_load_error" in r:
            print(f"  the app did not answer after the load: {r['after_load_error']}")
        elif r["kills"]:
            print("  kills: " + ", ".join(f"{k['target']} at {k['t_s']:.0f} s" for k in r["kills"]))
            print(f"  healed: {r['prefill_replacements']} prefill workers replaced, decode "
                  f"restarts {r['decode_restarts']}; requests run again by stage {r['retries']}; "
                  f"429s sent again {r['refused_then_sent_again']}")
    if "ttft_ratio_faults_over_baseline" in out:
        t = out["ttft_ratio_faults_over_baseline"]
        print(f"TTFT with faults / without: P50 {t['p50']:.2f}x, P99 {t['p99']:.2f}x")
    if "plot" in out:
        print(f"plot: {out['plot']}")
    print(f"zero failed: {'PASS' if v['zero_failed'] else 'FAIL'}; held after drain: "
          f"{'zero' if v['held_zero'] else 'NOT zero'}; every decode instance up: "
          f"{'yes' if v['decode_all_up'] else 'NO'}")
