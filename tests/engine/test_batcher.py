"""Batcher policy: decodes first, chunked prefill under the token budget, FCFS admission,
preemption of the newest sequence when blocks run out."""

from __future__ import annotations

from tetris.engine.batcher import Batcher
from tetris.engine.block_manager import BlockManager
from tetris.engine.request import Sequence, SequenceStatus
from tetris.sampling_params import SamplingParams


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, [1] * n, SamplingParams(), seed=None,
                    stop_token_ids=frozenset(), max_total_tokens=10_000)


def _run(plan) -> None:
    for sched in plan.decodes + plan.prefills:
        samples = sched.samples
        sched.seq.num_computed += sched.num_new_tokens
        if samples:
            sched.seq.tokens.append(2)


def test_long_prompt_is_chunked_by_the_token_budget_while_others_decode():
    batcher = Batcher(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    a = _seq("a", 3)
    batcher.add(a)
    plan = batcher.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.prefills] == [("a", 3)]
    _run(plan)
    b = _seq("b", 12)
    batcher.add(b)
    plan = batcher.schedule()
    assert [s.seq.request_id for s in plan.decodes] == ["a"]
    assert [(s.seq.request_id, s.num_new_tokens, s.samples) for s in plan.prefills] == [
        ("b", 7, False)]
    _run(plan)
    plan = batcher.schedule()
    assert [s.seq.request_id for s in plan.decodes] == ["a"]
    assert [(s.seq.request_id, s.num_new_tokens, s.samples) for s in plan.prefills] == [
        ("b", 5, True)]


def test_admission_is_fcfs_and_limited_by_seats():
    batcher = Batcher(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        batcher.add(_seq(rid, 2))
    plan = batcher.schedule()
    assert [s.seq.request_id for s in plan.prefills] == ["a", "b"]
    assert [s.request_id for s in batcher.waiting] == ["c"]


def test_head_of_queue_that_does_not_fit_blocks_later_ones():
    batcher = Batcher(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=100)
    batcher.add(_seq("a", 8))     # 3 blocks with the spare slot
    batcher.add(_seq("big", 8))   # does not fit next to a
    batcher.add(_seq("small", 1))  # would fit, but must not overtake "big"
    plan = batcher.schedule()
    assert [s.seq.request_id for s in plan.prefills] == ["a"]
    assert [s.request_id for s in batcher.waiting] == ["big", "small"]


def test_out_of_blocks_preempts_the_newest_and_recomputes_it_later():
    bm = BlockManager(4, 2)
    batcher = Batcher(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = _seq("a", 3), _seq("b", 3)
    batcher.add(a)
    batcher.add(b)
    _run(batcher.schedule())          # both prefilled: 2 blocks each, none free
    assert bm.num_free_blocks == 0 and a.num_tokens == 4
    _run(batcher.schedule())          # position 3 fits in the second blocks
    assert a.num_tokens == 5
    plan = batcher.schedule()         # a needs a third block: b (newest) is preempted
    assert [s.seq.request_id for s in plan.decodes] == ["a"]
    assert plan.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed == 0 and b.block_table == []
    assert b.tokens == [1, 1, 1, 2, 2]    # generated tokens are kept for the recompute
    assert [s.request_id for s in batcher.waiting] == ["b"]
    batcher.remove(a)
    plan = batcher.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.samples) for s in plan.prefills] == [
        ("b", 5, True)]


def test_lone_sequence_preempts_itself_when_cache_is_full():
    bm = BlockManager(2, 2)
    batcher = Batcher(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a = _seq("a", 3)
    batcher.add(a)
    _run(batcher.schedule())
    _run(batcher.schedule())
    assert a.num_tokens == 5
    plan = batcher.schedule()
    assert plan.empty and plan.preempted == [a] and bm.num_free_blocks == 2
