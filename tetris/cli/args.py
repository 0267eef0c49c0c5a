"""Argument types shared by the ``tetris`` subcommands (errors become argparse usage errors)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["positive_int", "positive_float", "positive_list", "add_emulated_trace_args",
           "add_load_args"]


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def positive_float(text: str) -> float:
    """A positive, finite float (argparse type)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be positive and finite, got {text!r}")
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


def add_load_args(p: argparse.ArgumentParser, *, load: float, duration: float) -> None:
    """The open-loop load's options, shared by ``tetris bench soak`` and ``tetris bench chaos``."""
    p.add_argument("--config", default="paper-llama3-8b-emulated.toml",
                   help="an emulated deployment (default: the paper's 8B cluster, emulated)")
    p.add_argument("--workload", default="short", help="short, medium or long")
    p.add_argument("--capacity", type=positive_float, default=None,
                   help="capacity in req/s of paper time (default: the simulator's, searched)")
    p.add_argument("--load", type=positive_float, default=load,
                   help=f"fraction of capacity ({load:g})")
    p.add_argument("--duration", type=positive_float, default=duration,
                   help="wall seconds of load")
    p.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="slow all emulated time and arrival gaps by this factor")
    p.add_argument("--max-output", type=positive_int, default=16, help="cap on output tokens")
    p.add_argument("--max-inflight", type=positive_int, default=512,
                   help="requests out at once; the sender waits beyond it")
    p.add_argument("--drain-timeout", type=positive_float, default=120.0,
                   help="wall seconds to wait for requests in flight when the load stops")
    p.add_argument("--capacity-requests", type=positive_int, default=1000,
                   help="requests per simulated probe of the capacity search")
    p.add_argument("--seed", type=int, default=0)
