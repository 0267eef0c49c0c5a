"""Commit-order tickets of the prefill pool (no Ray): progress, order, cancellation, stalls."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetris.actors.prefill.chunk_order import ChunkTickets
from tetris.actors.prefill.messages import PrefillError
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


def _timed(rid: str, chunks: list[tuple[tuple[int, ...], float]]) -> PrefillPlan:
    """A plan whose chunk ``k`` runs on ``chunks[k][0]`` for ``chunks[k][1]`` seconds (as
    planned from t = 0; only the durations matter to ``busy_for``)."""
    out, t = [], 0.0
    for k, (group, seconds) in enumerate(chunks):
        out.append(Chunk(10 * k, 10 * k + 10, group, expected_start=t, expected_end=t + seconds))
        t += seconds
    return PrefillPlan(rid, 10 * len(chunks), tuple(out))


def test_busy_for_replays_the_tickets_from_what_runs_now():
    t = ChunkTickets(3)
    x = _timed("x", [((1,), 2.0)])
    a = _timed("a", [((0,), 1.0), ((0, 1), 0.5)])   # its second chunk waits for x
    b = _timed("b", [((0,), 1.0)])                  # behind a's second chunk on instance 0
    for p in (x, a, b):
        t.commit(p)
    assert t.busy_for(100.0) == [3.5, 2.5, 0.0]      # nothing started: x 2, a 1 then 2..2.5, b 3.5
    t.start(x)
    t.wait_turn("x", 0, stall_s=1.0)                 # x starts now
    started = t._current["x"][1]
    assert t.busy_for(started + 0.5) == pytest.approx([3.0, 2.0, 0.0])   # x has 1.5 s left
    # x overdue: it ends "now" (unknown), and a's second chunk follows a's first
    assert t.busy_for(started + 5.0) == pytest.approx([2.5, 1.5, 0.0])
    t.chunk_done("x", 0)
    t.finish("x")
    assert t.busy_for(started + 5.0) == pytest.approx([2.5, 1.5, 0.0])
    t.start(a)
    t.wait_turn("a", 0, stall_s=1.0)
    t.chunk_done("a", 0)                              # a's first chunk is done: not counted again
    assert t.busy_for(200.0) == pytest.approx([1.5, 0.5, 0.0])
    t.cancel("b")
    assert t.busy_for(200.0) == pytest.approx([0.5, 0.5, 0.0])


@given(plans=growing_plans(), seconds=st.lists(st.floats(0.01, 3.0), min_size=18, max_size=18))
@settings(max_examples=60, deadline=None)
def test_busy_for_of_committed_plans_is_the_simulators_pool(plans, seconds):
    """Nothing started: the replay is the simulator's execution rule (tetris/sim/prefill.py)
    run on the same plans in commit order from an idle pool."""
    from tetris.sim.prefill import PrefillPoolSim

    it = iter(seconds)
    timed = [_timed(p.request_id, [(c.instances, next(it)) for c in p.chunks]) for p in plans]
    lengths = {(p.request_id, k): c.expected_end - c.expected_start
               for p in timed for k, c in enumerate(p.chunks)}
    t = ChunkTickets(POOL)
    sim = PrefillPoolSim(POOL, latency=lambda *_: 0.0)
    for p in timed:
        t.commit(p)
        sim.latency = lambda sp, history, tokens, rid=p.request_id: lengths[(rid, history // 10)]
        sim.execute(p, 0.0)
    assert t.busy_for(50.0) == pytest.approx(sim.free_at)
