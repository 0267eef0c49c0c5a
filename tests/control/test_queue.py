"""The one queue-time model (paper Eq. 2), its corrections and its report floor."""

from __future__ import annotations

import math

import pytest

from tetris.control import PrefillQueue
from tetris.plan import Chunk, PrefillPlan


def _plan(rid: str, *chunks: tuple[int, int, tuple[int, ...], float, float]) -> PrefillPlan:
    return PrefillPlan(rid, chunks[-1][1], tuple(Chunk(*c) for c in chunks))


def test_commit_books_every_member_until_its_chunks_expected_end():
    q = PrefillQueue([0, 0, 1, 1])
    q.commit(_plan("x", (0, 50, (1,), 0.0, 2.0), (50, 100, (1, 2), 2.0, 3.0)))
    assert q.queue_times(1.0) == [0.0, 3.0, 3.0, 0.0]
    assert q.bookings() == 2
    # a booking past its expected end is a chunk running late: busy now, not earlier
    assert q.queue_times(5.0) == [0.0, 5.0, 5.0, 0.0]


def test_finish_frees_early_at_the_finish_and_late_runs_at_their_end():
    q = PrefillQueue([0, 0])
    q.commit(_plan("early", (0, 10, (0,), 0.0, 4.0)))
    q.commit(_plan("late", (0, 10, (1,), 0.0, 2.0)))
    q.finish("early", now=3.0)      # beat its estimate: free from 3, not 4
    q.finish("late", now=6.0)       # ran 4 s over: free from the planned end onwards
    assert q.queue_times(1.0) == [3.0, 2.0] and q.bookings() == 0
    q.finish("early", now=9.0)      # idempotent
    assert q.queue_times(1.0) == [3.0, 2.0]


def test_holds_and_the_pools_report_are_floors():
    q = PrefillQueue([0, 0, 1, 1])
    q.hold([3], until=4.0)
    assert q.queue_times(1.0) == [0.0, 0.0, 0.0, 4.0] and q.bookings() == 0
    q.commit(_plan("x", (0, 100, (1,), 0.0, 2.0)))
    q.observe([1.0, 3.0, -2.0, math.inf], now=5.0)   # negative: idle for 2 s
    assert q.queue_times(5.0) == [6.0, 8.0, 3.0, 5.0 + PrefillQueue.REPLACING_S]
    q.observe([0.0, 0.5, 0.0, 0.0], now=7.0)          # the next report replaces it
    assert q.queue_times(7.0) == [7.0, 7.5, 7.0, 7.0]
    with pytest.raises(ValueError, match="reported 3 instances"):
        q.observe([0.0] * 3, now=8.0)
    with pytest.raises(ValueError, match="no prefill instance 7"):
        q.hold([7], until=2.0)


def test_a_plan_on_an_instance_the_pool_lacks_is_refused():
    q = PrefillQueue([0, 0])
    with pytest.raises(ValueError):
        q.commit(_plan("x", (0, 10, (2,), 0.0, 1.0)))
    assert q.bookings() == 0
