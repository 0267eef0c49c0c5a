"""Argument types shared by the ``tetris`` subcommands (errors become argparse usage errors)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["positive_int", "positive_list"]


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def positive_list(cast: Callable[[str], float], what: str) -> Callable[[str], list]:
    """An argparse type for a comma-separated list of positive ``cast`` values, e.g. ``1,16,64``."""

    def parse(text: str) -> list:
        try:
            vals = [cast(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}, got {text!r}") from None
        if not vals or min(vals) <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
        return vals

    return parse


def add_emulated_trace_args(p: argparse.ArgumentParser, *, requests: int, time_scale: float,
                            requests_help: str, time_scale_help: str) -> None:
    """The options every benchmark that replays a seeded trace on an emulated app shares."""
    p.add_argument("--requests", type=positive_int, default=requests, help=requests_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=time_scale, help=time_scale_help)
    p.add_argument("--max-output", type=positive_int, default=16,
                   help="cap on output tokens, for both runs (TTFT does not depend on it)")
