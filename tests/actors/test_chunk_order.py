"""Commit-order tickets of the prefill pool (no Ray): progress, order, cancellation, stalls."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetris.actors.chunk_order import ChunkTickets
from tetris.actors.prefill_messages import PrefillError
from tetris.plan import Chunk, PlanError, PrefillPlan

POOL = 5


def _plan(rid: str, groups: list[tuple[int, ...]]) -> PrefillPlan:
    return PrefillPlan(rid, 10 * len(groups), tuple(Chunk(10 * k, 10 * k + 10, g)
                                                    for k, g in enumerate(groups)))


def _runnable(t: ChunkTickets, plans: dict[str, PrefillPlan], nxt: dict[str, int]) -> list[str]:
    heads = {i: q[0] for i, q in t.pending().items()}
    return [rid for rid, k in sorted(nxt.items())
            if all(heads.get(i) == (rid, k) for i in plans[rid].chunks[k].instances)]


@st.composite
def growing_plans(draw):
    out = []
    for j in range(draw(st.integers(2, 6))):
        order = draw(st.permutations(list(range(POOL))))
        sizes = sorted(draw(st.lists(st.integers(1, POOL), min_size=1, max_size=3)))
        out.append(_plan(f"p{j}", [tuple(order[:s]) for s in sizes]))
    return out


@given(plans=growing_plans(), picks=st.lists(st.integers(0, 100), min_size=30, max_size=30))
@settings(max_examples=60, deadline=None)
def test_some_chunk_can_always_start_and_shared_instances_follow_commit_order(plans, picks):
    t = ChunkTickets(POOL)
    for p in plans:
        t.commit(p)
        t.start(p)
    by_id = {p.request_id: p for p in plans}
    nxt = {p.request_id: 0 for p in plans}
    rank = {p.request_id: j for j, p in enumerate(plans)}
    last_on: dict[int, int] = {}   # instance -> commit rank of the last chunk run there
    step = 0
    while nxt:
        ready = _runnable(t, by_id, nxt)
        assert ready, f"no chunk can start: {t.pending()}"
        rid = ready[picks[step % len(picks)] % len(ready)]
        step += 1
        k = nxt[rid]
        t.wait_turn(rid, k, stall_s=0.1)   # returns at once: it is this chunk's turn
        for i in by_id[rid].chunks[k].instances:
            assert last_on.get(i, -1) <= rank[rid]
            last_on[i] = rank[rid]
        t.chunk_done(rid, k)
        if k + 1 == len(by_id[rid].chunks):
            t.finish(rid)
            del nxt[rid]
        else:
            nxt[rid] = k + 1
    assert t.pending() == {}


def test_later_plan_waits_for_the_earlier_one_on_shared_instances():
    t = ChunkTickets(POOL)
    a, b = _plan("a", [(0,), (0, 1)]), _plan("b", [(1,)])
    t.commit(a)
    t.start(b)                       # not committed: run commits it behind "a"
    t.start(a)
    started = threading.Event()

    def run_b():
        t.wait_turn("b", 0, stall_s=5)
        started.set()

    th = threading.Thread(target=run_b)
    th.start()
    t.wait_turn("a", 0, stall_s=1)
    t.chunk_done("a", 0)
    assert not started.wait(0.1)     # "a" chunk 1 (on 0, 1) is still ahead of "b" on 1
    t.wait_turn("a", 1, stall_s=1)
    t.chunk_done("a", 1)
    assert started.wait(5)
    th.join()
    t.finish("a")
    t.finish("b")
    assert t.pending() == {}


def test_cancel_before_start_unblocks_and_fails_its_run():
    t = ChunkTickets(POOL)
    t.commit(_plan("x", [(2, 3)]))
    t.commit(_plan("y", [(3,)]))
    with pytest.raises(PlanError, match="already committed"):
        t.commit(_plan("y", [(3,)]))
    t.cancel("x")
    t.start(_plan("y", [(3,)]))
    t.wait_turn("y", 0, stall_s=0.1)
    with pytest.raises(PrefillError, match="aborted before"):
        t.start(_plan("x", [(2, 3)]))
    t.start(_plan("x", [(2, 3)]))    # the failure was reported once; the id can be reused
    t.finish("x")
    t.finish("y")
    assert t.pending() == {}


def test_cancel_during_a_chunk_keeps_its_ticket_until_it_ends():
    t = ChunkTickets(POOL)
    p = _plan("r", [(0,), (0, 1)])
    t.start(p)
    t.commit(_plan("s", [(0,)]))
    t.wait_turn("r", 0, stall_s=1)
    t.cancel("r")
    assert t.pending() == {0: [("r", 0), ("s", 0)]}   # chunk 0 still executes on instance 0
    with pytest.raises(PrefillError, match="aborted during"):
        t.wait_turn("r", 1, stall_s=1)
    t.finish("r")
    t.wait_turn("s", 0, stall_s=0.1)


def test_a_committed_plan_that_never_runs_stalls_later_ones_with_a_clear_error():
    t = ChunkTickets(POOL)
    t.commit(_plan("ghost", [(4,)]))
    t.start(_plan("late", [(4,)]))
    with pytest.raises(PrefillError, match=r"waited 0.05s without progress behind requests \['ghost'\]"):
        t.wait_turn("late", 0, stall_s=0.05)


def test_a_plan_cannot_run_twice_or_change_after_commit():
    t = ChunkTickets(POOL)
    t.commit(_plan("d", [(0,)]))
    with pytest.raises(PlanError, match="another plan"):
        t.start(_plan("d", [(1,)]))
    t.start(_plan("d", [(0,)]))
    with pytest.raises(PlanError, match="already running"):
        t.start(_plan("d", [(0,)]))
