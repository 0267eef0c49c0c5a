"""``tetris bench``: measured benchmarks, one subcommand each.

Add a benchmark with one line in ``BENCHES`` and a ``_add_<name>`` / ``_run_<name>`` pair (or a
module of its own); every subcommand takes ``--json`` and then prints exactly one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from tetris.cli.args import positive_int, positive_list

__all__ = ["register"]


def _add_transfer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=positive_list(int, "sizes in MiB"), default=[1, 16, 64], help="write sizes in MiB (default 1,16,64)")
    p.add_argument("--iters", type=positive_int, default=10, help="timed writes per size (median reported)")
    p.add_argument("--requests", type=positive_int, default=50, help="requests for the handshake overhead")


def _run_transfer(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from tetris.transfer.bench import run_transfer_bench

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


# name -> (help, add arguments, run -> dict, print the dict for people)
BENCHES = {
    "transfer": ("NIXL throughput between two Ray actors vs an in-process copy; handshake overhead",
                 _add_transfer, _run_transfer, _print_transfer),
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (transfer, ...)")
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
