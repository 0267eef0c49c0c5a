"""Timer slack for the threads a gloo process group starts (issue #20: idle CPU).

Each gloo process group runs a transport thread (``gloo_tcp_loop``) that ``epoll_wait``s with a
10 ms timeout, a literal in gloo's TCP loop, so an idle group wakes each of its processes 100
times a second (~0.15% of a core per process on the 2-core dev VM; docs/benchmarks.md, "Ray's
own timers"). Linux lets a thread widen the slack of its timeouts (``prctl(PR_SET_TIMERSLACK)``):
a 10 ms ``epoll_wait`` may then end anywhere up to 10 ms + slack, so the kernel folds the idle
ticks into other wake-ups. Data is not delayed: a readable socket ends the wait at once, slack
only stretches waits that time out. What does wait for a tick is gloo closing a connection
(``unregisterDescriptor`` waits for the loop to go round), so tearing a group down takes up to
one slack longer per connection.

The thread inherits the slack of the thread that creates it, so ``loose_timers`` widens the
caller's slack around the group's construction and restores it after: only threads started
inside the block keep it. The period comes from ``TETRIS_GLOO_TIMER_SLACK_MS`` (unset or 0:
nothing changes); ``tetris serve`` sets it (``tetris/serve/ray_idle.py``) and every worker the
Ray it starts spawns inherits it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator

__all__ = ["ENV_VAR", "loose_timers", "slack_ns"]

ENV_VAR = "TETRIS_GLOO_TIMER_SLACK_MS"
_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30


def slack_ns() -> int:
    """The slack to give new gloo threads, from the environment (0: none)."""
    try:
        return max(0, int(float(os.environ.get(ENV_VAR, "0")) * 1_000_000))
    except ValueError:
        return 0


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def loose_timers(ns: int | None = None) -> Iterator[int]:
    """Threads started inside the block get ``ns`` of timer slack (default ``slack_ns()``);
    the calling thread's own slack is restored on exit. Yields the slack set (0: none)."""
    ns = slack_ns() if ns is None else ns
    prctl = _prctl() if ns > 0 else None
    old = prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) if prctl is not None else -1
    if old < 0 or prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) != 0:
        yield 0
        return
    try:
        yield ns
    finally:
        prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(old), 0, 0, 0)
