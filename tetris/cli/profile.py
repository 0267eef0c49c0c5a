"""``tetris profile``: fit the prefill latency model (paper Eq. 1) to a CSV, or show a profile.

    tetris profile fit configs/profiles/paper_table1_llama3_8b_a100.csv --out my.json
    tetris profile show a100-llama3-70b-tp4
"""

from __future__ import annotations

import argparse
import json
import sys

from tetris.scheduler.latency import PrefillLatencyModel, ProfileError, load_profile, read_table_csv


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="fit or show prefill latency profiles",
                       description=__doc__.splitlines()[0])
    ps = p.add_subparsers(dest="profile_command", metavar="ACTION", required=True)
    f = ps.add_parser("fit", help="fit Eq. 1 per SP size to a latency CSV")
    f.add_argument("csv", help="columns prompt_tokens[, history_tokens], sp1, sp2, ... (seconds)")
    f.add_argument("--out", help="write the profile JSON here")
    f.add_argument("--name", default=None, help="profile name (default: the CSV's stem)")
    f.add_argument("--gamma-over-delta", type=float, default=2.0,
                   help="γ/δ when the CSV has no history (SPEC §2: 2)")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=run_fit)
    s = ps.add_parser("show", help="print a profile's coefficients")
    s.add_argument("profile", help="embedded name or JSON path")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=run_show)


def _coeff_rows(m: PrefillLatencyModel) -> list[dict]:
    return [{"sp_size": c.sp_size, "alpha": c.alpha, "beta": c.beta, "gamma": c.gamma,
             "delta": c.delta} for c in m.coefficients]


def _print_coeffs(m: PrefillLatencyModel) -> None:
    print("T_s(h, l) = α + β·l + γ·h·l + δ·l²   (seconds)")
    print(f"{'SP':>4} {'α':>10} {'β':>12} {'γ':>12} {'δ':>12}")
    for c in m.coefficients:
        print(f"{c.sp_size:>4} {c.alpha:>10.4g} {c.beta:>12.4e} {c.gamma:>12.4e} {c.delta:>12.4e}")


def run_fit(args: argparse.Namespace) -> int:
    from pathlib import Path

    try:
        samples = read_table_csv(args.csv)
        name = args.name or Path(args.csv).stem
        m = PrefillLatencyModel.fit(samples, name=name, gamma_over_delta=args.gamma_over_delta,
                                    source=f"fitted to {Path(args.csv).name}")
    except ProfileError as e:
        print(f"tetris profile fit: {e}", file=sys.stderr)
        return 2
    errs = m.relative_errors(samples)
    if args.out:
        m.save(args.out)
    if args.json:
        print(json.dumps({
            "name": m.name, "coefficients": _coeff_rows(m), "max_relative_error": m.max_relative_error,
            "cells": [{"sp_size": s.sp_size, "history_tokens": s.history_tokens,
                       "chunk_tokens": s.chunk_tokens, "measured_s": s.seconds,
                       "predicted_s": s.seconds * (1 + e), "relative_error": e} for s, e in errs],
            "out": args.out,
        }))
        return 0
    _print_coeffs(m)
    sps = sorted({s.sp_size for s, _ in errs})
    rows = sorted({(s.history_tokens, s.chunk_tokens) for s, _ in errs})
    cell = {(s.history_tokens, s.chunk_tokens, s.sp_size): e for s, e in errs}
    print("\nrelative error (predicted / measured − 1) per cell:")
    print(f"{'h':>8} {'l':>8} " + " ".join(f"{'SP' + str(s):>7}" for s in sps))
    for h, l in rows:
        vals = [cell.get((h, l, s)) for s in sps]
        print(f"{h:>8} {l:>8} " + " ".join("      -" if v is None else f"{v:>+7.1%}" for v in vals))
    print(f"\nmax |error| {m.max_relative_error:.1%} over {len(errs)} cells"
          + (f"; written to {args.out}" if args.out else ""))
    return 0


def run_show(args: argparse.Namespace) -> int:
    try:
        m = load_profile(args.profile)
    except ProfileError as e:
        print(f"tetris profile show: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"name": m.name, "model": m.model, "hardware": m.hardware,
                          "tp_size": m.tp_size, "source": m.source, "notes": list(m.notes),
                          "coefficients": _coeff_rows(m)}))
        return 0
    print(f"{m.name}: {m.model} on {m.hardware}, TP {m.tp_size}; {m.source}")
    for n in m.notes:
        print(f"  - {n}")
    _print_coeffs(m)
    return 0
