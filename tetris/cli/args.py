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
