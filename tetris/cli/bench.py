"""``tetris bench``: measured benchmarks, one subcommand each.

The benchmarks themselves live in ``tetris.bench`` and take their values as parameters; this
module and ``tetris/cli/bench_<name>.py`` parse the options and print. Add a benchmark with one
line in ``BENCHES`` and a ``_add_<name>`` / ``_run_<name>`` pair (or a module of its own); every
subcommand takes ``--json`` and then prints exactly one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from tetris.cli import bench_chaos, bench_kunserve, bench_policies, bench_soak
from tetris.cli.args import add_emulated_trace_args, positive_int, positive_list

__all__ = ["register"]


def _add_transfer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=positive_list(int, "sizes in MiB"), default=[1, 16, 64], help="write sizes in MiB (default 1,16,64)")
    p.add_argument("--iters", type=positive_int, default=10, help="timed writes per size (median reported)")
    p.add_argument("--requests", type=positive_int, default=50, help="requests for the handshake overhead")


def _run_transfer(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from tetris.bench.transfer import run_transfer_bench

    with tqdm(total=len(args.sizes) + args.requests, desc="bench transfer", disable=args.json,
              file=sys.stderr) as bar:
        return run_transfer_bench(args.sizes, args.iters, args.requests, tick=bar.update)


def _print_transfer(out: dict) -> None:
    print(f"{'MiB':>6} {'NIXL GiB/s':>11} {'copy GiB/s':>11} {'NIXL/copy':>10}")
    for row in out["throughput"]:
        print(f"{row['size_mib']:>6} {row['nixl_gib_s']:>11.2f} {row['torch_copy_gib_s']:>11.2f} "
              f"{row['nixl_over_copy']:>10.2f}")
    hs = out["handshake"]
    print(f"handshake round trip through Ray: mean {hs['mean_us']:.0f} us, median {hs['median_us']:.0f} us "
          f"({hs['ray_calls_per_handshake']} Ray calls, {hs['requests']} requests)")


def _add_fidelity(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="paper-llama3-8b-emulated.toml",
                   help="an emulated deployment (default: the paper's 8B cluster, emulated)")
    p.add_argument("--workload", default="short", help="short, medium, long or a trace file")
    p.add_argument("--rate", type=positive_list(float, "rates in req/s"), default=[1.0],
                   help="arrival rate(s) in req/s of paper time, comma-separated (default 1)")
    add_emulated_trace_args(p, requests=40, time_scale=1.0, requests_help="requests per rate",
                            time_scale_help="slow all emulated time by this factor (the machine "
                                            "cannot keep up)")


def _run_fidelity(args: argparse.Namespace) -> dict:
    import contextlib

    from tqdm import tqdm

    from tetris.bench.fidelity import run_fidelity

    if args.time_scale <= 0:
        raise SystemExit("tetris bench fidelity: --time-scale must be positive")
    # Ray's driver prints raylet warnings on stdout; --json must print one object there only.
    with contextlib.redirect_stdout(sys.stderr), tqdm(
            total=len(args.rate) * args.requests, desc="bench fidelity (EMULATION)",
            disable=args.json, file=sys.stderr) as bar:
        return run_fidelity(args.config, workload=args.workload, rates=args.rate,
                            requests=args.requests, seed=args.seed, time_scale=args.time_scale,
                            max_output=args.max_output, tick=bar.update)


def _print_fidelity(out: dict) -> None:
    print(f"{out['label']}; time scale {out['time_scale']:g}, {out['workload']} workload, "
          f"{out['requests']} requests per rate")
    print(f"{'rate':>6} {'sim P50':>8} {'live P50':>9} {'ratio':>6} {'sim P99':>8} {'live P99':>9} "
          f"{'ratio':>6} {'failed':>6} {'plan us':>8} {'handoff ms':>10} {'ray/req':>8}")
    for r in out["runs"]:
        cp = r["control_plane"]
        calls = sum(cp["ray_calls_per_request"].values())
        print(f"{r['rate']:>6g} {r['sim_ttft_s']['p50']:>8.3f} {r['live_ttft_s']['p50']:>9.3f} "
              f"{r['ratio_p50']:>6.3f} {r['sim_ttft_s']['p99']:>8.3f} {r['live_ttft_s']['p99']:>9.3f} "
              f"{r['ratio_p99']:>6.3f} {r['failed']:>6} {cp['decision_us_mean']:>8.0f} "
              f"{cp['handoff_ms']['p50']:>10.1f} {calls:>8.0f}")
    for r in out["runs"]:
        pr = r["per_request"]
        print(f"rate {r['rate']:g}: {pr['same_plan']} requests planned alike live and simulated "
              f"(mean live - sim TTFT {pr['mean_gap_same_plan_s'] * 1e3:+.1f} ms), "
              f"{pr['other_plan']} planned differently ({pr['mean_gap_other_plan_s'] * 1e3:+.1f} ms)")


# name -> (help, add arguments, run -> dict, print the dict for people)
BENCHES = {
    "policies": ("EMULATION: live vs simulated TTFT per policy and rate; do the policy orders agree",
                 bench_policies.add_args, bench_policies.run, bench_policies.show),
    "soak": ("EMULATION: open-loop soak at a fraction of capacity: failures and actor memory growth",
             bench_soak.add_args, bench_soak.run, bench_soak.show),
    "chaos": ("EMULATION: open-loop load while prefill workers and decode ranks are killed",
              bench_chaos.add_args, bench_chaos.run, bench_chaos.show),
    "transfer": ("NIXL throughput between two Ray actors vs an in-process copy; handshake overhead",
                 _add_transfer, _run_transfer, _print_transfer),
    "fidelity": ("EMULATION: live emulated cluster vs simulator, TTFT P50/P99 on one seeded trace",
                 _add_fidelity, _run_fidelity, _print_fidelity),
    "kunserve": ("SIMULATION (+ EMULATION with --emulated): KunServe vs baselines, KV burst",
                 bench_kunserve.add_args, bench_kunserve.run, bench_kunserve.show),
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (transfer, fidelity, soak, chaos, policies)")
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (help_text, add, _, _) in BENCHES.items():
        p = sub.add_parser(name, help=help_text)
        add(p)
        p.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    _, _, run, show = BENCHES[args.bench]
    out = run(args)
    if args.json:
        print(json.dumps(out))
    else:
        show(out)
    return 0
