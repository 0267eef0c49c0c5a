"""Block manager: check/act pairs, ownership, and that every block comes back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetris.engine.batcher import Batcher
from tetris.engine.block_manager import BlockManager, OutOfBlocksError
from tetris.engine.request import Sequence
from tetris.sampling_params import SamplingParams


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(), seed=None,
                    stop_token_ids=frozenset(), max_total_tokens=10_000)


def test_allocate_rounds_up_to_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = _seq("a", 9)
    assert bm.can_allocate(9)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    assert seq.block_table == [0, 1, 2]
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []


def test_can_allocate_has_no_side_effect_and_allocate_refuses_without_room():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(9)
    assert bm.num_free_blocks == 2
    with pytest.raises(OutOfBlocksError, match="needs 3 blocks, 2 free"):
        bm.allocate(_seq("big", 9))
    assert bm.num_free_blocks == 2


def test_append_slot_takes_a_block_only_at_a_boundary():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = _seq("a", 4)
    bm.allocate(seq)
    assert len(seq.block_table) == 1
    seq.tokens.append(7)  # fifth token: needs the second block
    assert bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2
    seq.tokens.append(8)  # sixth token fits in the second block
    bm.append_slot(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1


def test_can_append_false_when_full_and_append_raises():
    bm = BlockManager(num_blocks=1, block_size=2)
    seq = _seq("a", 2)
    bm.allocate(seq)
    seq.tokens.append(3)
    assert not bm.can_append(seq)
    with pytest.raises(OutOfBlocksError):
        bm.append_slot(seq)


def test_double_allocate_rejected():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = _seq("a", 2)
    bm.allocate(seq)
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate(seq)


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="positive"):
        BlockManager(num_blocks=0, block_size=16)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(min_value=1, max_value=20)),
        st.tuples(st.just("step"), st.just(0)),
        st.tuples(st.just("abort"), st.integers(min_value=0, max_value=30)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, num_blocks=st.integers(min_value=6, max_value=24))
def test_random_add_decode_abort_returns_every_block(ops, num_blocks):
    """Drive the batcher as the engine does, without a model: blocks are never double-owned,
    and once every sequence is finished or aborted the free count is back to the start."""
    bm = BlockManager(num_blocks=num_blocks, block_size=4)
    batcher = Batcher(bm, max_num_seqs=4, max_num_batched_tokens=16)
    live: list[Sequence] = []
    for i, (op, arg) in enumerate(ops):
        if op == "add" and bm.blocks_needed(arg + 1) <= num_blocks:
            seq = _seq(f"r{i}", arg)
            live.append(seq)
            batcher.add(seq)
        elif op == "abort" and live:
            seq = live.pop(arg % len(live))
            batcher.remove(seq)
        elif op == "step":
            _fake_step(batcher, live)
        owned = [b for s in live for b in s.block_table]
        assert len(owned) == len(set(owned))
        assert len(owned) + bm.num_free_blocks == num_blocks
    for _ in range(200):
        if not live:
            break
        _fake_step(batcher, live)
    for seq in list(live):
        batcher.remove(seq)
    assert bm.num_free_blocks == num_blocks


def _fake_step(batcher: Batcher, live: list[Sequence]) -> None:
    plan = batcher.schedule()
    for sched in plan.decodes + plan.prefills:
        seq = sched.seq
        assert len(seq.block_table) * 4 >= seq.num_tokens
        samples = sched.samples
        seq.num_computed += sched.num_new_tokens
        if samples:
            seq.tokens.append(5)
            if seq.num_tokens - seq.num_prompt_tokens >= 6:  # max_tokens of the fake
                batcher.remove(seq)
                live.remove(seq)
