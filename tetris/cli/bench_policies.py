"""``tetris bench policies``: its options, run and printout (the benchmark is
``tetris.bench.policies``)."""

from __future__ import annotations

import argparse
import contextlib
import sys

from tetris.bench.policies import (DEFAULT_POLICIES, DEFAULT_RATES, DEFAULT_TIE, METRICS, plot,
                                   run_policies)
from tetris.cli.args import add_emulated_trace_args, positive_list

__all__ = ["add_args", "run", "show"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="paper-llama3-8b-emulated.toml",
                   help="an emulated deployment (default: the paper's 8B cluster, emulated)")
    p.add_argument("--policies", type=_policy_list, default=list(DEFAULT_POLICIES),
                   help=f"comma-separated disaggregated policies (default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--workload", default="short", help="short, medium, long or a trace file")
    p.add_argument("--rate", type=positive_list(float, "rates in req/s"), default=list(DEFAULT_RATES),
                   help="arrival rates in req/s of paper time (default 1,3,5: light, 0.7x and "
                        "1.15x the simulated capacity of fixed-sp-8 on Short)")
    add_emulated_trace_args(p, requests=30, time_scale=10.0, requests_help="requests per (policy, rate)",
                            time_scale_help="slow all emulated time by this factor (default 10, as for "
                                            "fidelity)")
    p.add_argument("--tie", type=float, default=DEFAULT_TIE,
                   help="relative gap under which the simulator's TTFTs count as a tie (default 0.05)")
    p.add_argument("--sim-only", action="store_true",
                   help="run the simulator alone (the predicted orders, in seconds)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write TTFT P50/P99 vs rate (solid: live, dashed: simulator) to PATH")


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    if args.time_scale <= 0:
        raise SystemExit("tetris bench policies: --time-scale must be positive")
    if not 0 <= args.tie < 1:
        raise SystemExit("tetris bench policies: --tie must be in [0, 1)")
    total = 0 if args.sim_only else len(args.policies) * len(args.rate) * args.requests
    # Ray's driver prints raylet warnings on stdout; --json must print one object there only.
    with contextlib.redirect_stdout(sys.stderr), tqdm(
            total=total, desc="bench policies (EMULATION)", file=sys.stderr,
            disable=getattr(args, "json", False) or args.sim_only) as bar:
        out = run_policies(args.config, policies=args.policies, rates=args.rate,
                           workload=args.workload, requests=args.requests, seed=args.seed,
                           time_scale=args.time_scale, max_output=args.max_output, tie=args.tie,
                           live=not args.sim_only, tick=bar.update)
    if args.plot:
        plot(out, args.plot)
        out["plot"] = str(args.plot)
    return out


def show(out: dict) -> None:
    print(f"{out['label']}; time scale {out['time_scale']:g}, {out['workload']} workload, "
          f"{out['requests']} requests per (policy, rate); TTFT in paper seconds")
    live = out["emulation"]
    print(f"{'policy':<18} {'rate':>5} {'sim P50':>8} {'sim P99':>8}" + (
        f" {'live P50':>9} {'live P99':>9} {'failed':>6} {'chunks':>6} {'mean SP':>7}" if live else ""))
    for r in out["results"]:
        line = f"{r['policy']:<18} {r['rate']:>5g} {r['sim_ttft_s']['p50']:>8.3f} {r['sim_ttft_s']['p99']:>8.3f}"
        if live:
            lt, pl = r["live_ttft_s"], r["live_plans"]
            line += (f" {lt['p50']:>9.3f} {lt['p99']:>9.3f} {r['failed']:>6} "
                     f"{pl['chunks_mean']:>6.2f} {pl['sp_mean']:>7.2f}")
        print(line)
    for o in out["orders"]:
        for m in METRICS:
            c = o[m]
            ties = "".join(f" ({a} ~ {b} in sim)" for a, b in c["sim_ties"])
            line = f"rate {o['rate']:g} {m.upper()}: sim {' < '.join(c['sim'])}{ties}"
            if c["agree"] is not None:
                verdict = "agree" if c["agree"] else f"DISAGREE on {c['discordant']}"
                line += f" | live {' < '.join(c['live'])}: {verdict}"
            print(line)
    if out["orders_agree"] is not None:
        print(f"orders agree at every rate: {out['orders_agree']} "
              f"(P50 alone: {out['orders_agree_p50']})")


def _policy_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated policy names, got {text!r}")
    return names
