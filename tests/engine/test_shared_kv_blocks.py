"""Prefix caching's decode side shares blocks by reference count (engine/block_manager.py,
engine/kept_kv.py): a second turn holds the first turn's full prefix blocks in its own table,
only the boundary block is copied (copy-on-write), its greedy tokens and logprobs equal the
same turn run without caching, a shared block is counted once, and freeing in either order
returns every block exactly once (the holders of each block are exactly the tables holding it).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy_reference, prefill_kv, tiny_model
from tetris.kernels.paged_decode import write_kv

from tetris.engine.block_manager import BlockManager
from tetris.engine.engine import LLMEngine
from tetris.engine.kept_kv import KeptKV
from tetris.engine.logprobs import logprobs_of_rows
from tetris.engine.request import Sequence
from tetris.sampling_params import SamplingParams

BS = 4
TURN = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
P1 = [(i * 7) % 300 + 5 for i in range(30)]   # 30 tokens: turn 1 keeps 30 + 7 positions


def _run(engine, rid):
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                logprobs += out.new_logprobs
    return tokens, logprobs


@torch.inference_mode()
def _prefill(model, prompt):
    """Every layer's K/V of ``prompt`` as one prefill computes them, and the first token with
    its logprob (what a prefill instance streams and sends)."""
    kv, row = prefill_kv(model, prompt)
    first = int(row[0].argmax(-1))
    return kv, first, logprobs_of_rows(row, [first], TURN.logprobs)[0]


def _receive(engine, rid, prompt, table, start, prefill):
    """Write positions ``[start, len(prompt))`` as the prefill streams them, then commit."""
    kv, first, logprob = prefill
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(start, len(prompt))])
    for layer, (k, v) in enumerate(kv):
        write_kv(engine.cache.k[layer], engine.cache.v[layer], k[start:], v[start:], slots)
    engine.commit_prefilled(rid, first, logprob)


def _first_turn(num_blocks=48):
    model, tok = tiny_model()
    engine = LLMEngine(model, tok, num_blocks=num_blocks, block_size=BS)
    kept = KeptKV(engine)
    kept.want("t1")
    engine.add_request("t1", P1, TURN)
    out1, _ = _run(engine, "t1")
    return model, tok, engine, kept, P1 + out1


def _tables(engine, kept):
    """Every table holding blocks: running requests' and kept runs'."""
    tables = {rid: s.block_table for rid, s in engine._seqs.items() if s.block_table}
    tables.update({run: table for run, (table, _) in kept.runs.items()})
    return tables


@pytest.mark.parametrize("reuse", [32, 35], ids=["on-a-block-boundary", "inside-a-block"])
def test_a_second_turn_shares_the_prefix_blocks_and_equals_the_uncached_run(reuse):
    model, tok, engine, kept, history = _first_turn()
    p2 = history + [11, 12, 13, 14, 15]
    prefill = _prefill(model, p2)
    # without caching: the whole prompt streamed into blocks of its own
    plain = LLMEngine(model, tok, num_blocks=48, block_size=BS)
    _receive(plain, "t2", p2, plain.reserve_blocks("t2", p2, TURN), 0, prefill)
    want_tokens, want_logprobs = _run(plain, "t2")

    before = engine.num_free_blocks
    shared = kept.shared_blocks("t1", reuse)
    assert shared == kept.runs["t1"][0][:reuse // BS] and len(shared) == 8
    table = engine.reserve_blocks("t2", p2, TURN, shared=shared)
    kept.copy_boundary("t1", table, reuse)
    unshared = len(table) - len(shared)
    assert table[:8] == shared and not set(table[8:]) & set(kept.runs["t1"][0])
    # a shared block is counted once: only the unshared blocks left the free list
    assert engine.num_free_blocks == engine.stats().free_blocks == before - unshared
    assert [engine.blocks.refcount(b) for b in table] == [2] * 8 + [1] * unshared
    engine.blocks.check(_tables(engine, kept))

    _receive(engine, "t2", p2, table, reuse, prefill)   # only the suffix is streamed
    tokens, logprobs = _run(engine, "t2")
    assert tokens == want_tokens and len(logprobs) == len(want_logprobs) == 8
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert got.token_id == want.token_id
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        # turn 1's KV came from decode steps, the reference's from one prefill: fp32 close
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    # turn 1's blocks are as it left them: the boundary block was copied, not written
    kv1, _, _ = _prefill(model, history)
    slots = torch.tensor([b * BS + p % BS for p, b in
                          ((p, kept.runs["t1"][0][p // BS]) for p in range(len(history) - 1))])
    for layer, (k, _) in enumerate(kv1):
        got_k, _ = engine.cache.gather(layer, slots)
        assert torch.allclose(got_k, k[:len(history) - 1], atol=1e-5), layer
    assert kept.drop("t1") and engine.num_free_blocks == 48
    engine.blocks.check({})


@pytest.mark.parametrize("drop_first", [True, False], ids=["run-dropped-first", "reader-first"])
def test_freeing_in_either_order_returns_every_block_once(drop_first):
    model, _, engine, kept, history = _first_turn()
    p2 = history + [21, 22, 23]
    table = engine.reserve_blocks("t2", p2, TURN, shared=kept.shared_blocks("t1", 35))
    kept.copy_boundary("t1", table, 35)
    kept.want("t2")   # the reader is kept in turn, still holding turn 1's blocks
    _receive(engine, "t2", p2, table, 35, _prefill(model, p2))
    # a third turn shares from the second: the first 8 blocks are held three times
    engine.step()
    p3_table = engine.reserve_blocks("t3", p2[:34] + [40], TURN,
                                     shared=kept.shared_blocks("t1", 32))
    assert [engine.blocks.refcount(b) for b in p3_table[:8]] == [3] * 8
    engine.blocks.check(_tables(engine, kept))
    if drop_first:
        assert kept.drop("t1")
        engine.blocks.check(_tables(engine, kept))
        assert [engine.blocks.refcount(b) for b in table[:8]] == [2] * 8
    engine.abort_request("t3")
    engine.blocks.check(_tables(engine, kept))
    _run(engine, "t2")
    assert list(kept.runs) == (["t2"] if drop_first else ["t1", "t2"])
    engine.blocks.check(_tables(engine, kept))
    assert [engine.blocks.refcount(b) for b in table[:8]] == [1 if drop_first else 2] * 8
    for run in list(kept.runs):
        assert kept.drop(run)
        engine.blocks.check(_tables(engine, kept))
    assert engine.num_free_blocks == 48 and _tables(engine, kept) == {}


def test_a_reservation_needs_only_its_unshared_blocks():
    # 20 blocks: turn 1 keeps 10, 10 free; turn 2 (40 tokens + its first output) needs 11 of
    # its own, but only 3 when it shares turn 1's first 8
    _, _, engine, kept, history = _first_turn(num_blocks=20)
    p2 = history + [11, 12, 13]
    assert engine.num_free_blocks == 10 and not engine.can_reserve(len(p2))
    assert engine.can_reserve(len(p2), 8)
    assert kept.make_room(len(p2), "t1", 8) == [] and "t1" in kept.runs
    table = engine.reserve_blocks("t2", p2, TURN, shared=kept.shared_blocks("t1", 32))
    assert engine.num_free_blocks == 10 - 3 and len(table) == 11


def _seq(rid, tokens):
    return Sequence(rid, list(tokens), TURN, seed=None, stop_token_ids=frozenset(),
                    max_total_tokens=64)


def test_a_write_into_a_shared_block_is_refused():
    blocks = BlockManager(8, BS)
    run = _seq("run", range(10, 18))
    blocks.allocate(run)
    reader = _seq("reader", range(10, 18))
    blocks.allocate(reader, shared=run.block_table)   # both blocks shared, as full as they are
    assert reader.block_table == run.block_table and blocks.num_free_blocks == 6
    with pytest.raises(AssertionError, match="a write into blocks"):
        blocks.assert_exclusive(reader.block_table)
    reader.tokens.append(99)   # its next token's KV goes to a block of its own
    blocks.append_slot(reader)
    assert blocks.refcount(reader.block_table[-1]) == 1
    with pytest.raises(ValueError, match="cannot share"):   # a free block is nobody's to share
        blocks.allocate(_seq("x", [1, 2, 3]), shared=[7])
    blocks.free(run)
    blocks.check({"reader": reader.block_table})
    blocks.free(reader)
    blocks.check({})


def test_a_shared_block_as_the_last_block_refuses_the_step_that_would_write_it():
    blocks = BlockManager(8, BS)
    run = _seq("run", range(10, 18))
    blocks.allocate(run)
    # a reader whose every position (8, its newest included) lies in the shared blocks: its
    # step would write the newest token's KV into the run's block
    reader = _seq("reader", range(10, 18))
    blocks.allocate(reader, shared=run.block_table)
    with pytest.raises(AssertionError, match="a write into blocks"):
        blocks.append_slot(reader)


def test_kept_runs_keep_a_group_from_forming():
    from engine_helpers import TINY

    from tetris.engine.pipeline_group import PipelineGroup
    from tetris.model.loader import load_model

    engines = [LLMEngine(*load_model(TINY), num_blocks=16, block_size=BS) for _ in range(2)]
    group = PipelineGroup(engines, [(0, 1), (1, 2)])
    group.check_drop()   # a group may form of these engines
    KeptKV(engines[0])   # its blocks may be shared: the group's block copies would not be
    with pytest.raises(ValueError, match="keeping finished runs"):
        group.check_drop()


def test_kept_runs_yield_blocks_to_growing_requests_before_any_preemption():
    # 17 blocks: turn 1 keeps 10; turn 2 shares 8 of them and holds 3 of its own; another
    # request takes the last 4. Both grow: without the kept run yielding, turn 2 (the newest)
    # would be preempted, let go of only its 3 own blocks and need 12 fresh ones to come back,
    # which the kept run holds (the engine would stall). Kept KV never makes the engine refuse
    # a request: turn 1 is dropped (its 2 unshared blocks freed) and no one is preempted.
    model, _, engine, kept, history = _first_turn(num_blocks=17)
    engine.add_request("other", list(range(40, 53)), TURN)
    tokens = {"other": [t for out in engine.step() for t in out.new_token_ids]}
    p2 = history + [11, 12, 13]
    table = engine.reserve_blocks("t2", p2, TURN, shared=kept.shared_blocks("t1", 35))
    kept.copy_boundary("t1", table, 35)
    _receive(engine, "t2", p2, table, 35, _prefill(model, p2))
    assert engine.num_free_blocks == 0
    preempted = 0
    for _ in range(100):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.blocks.check(_tables(engine, kept))
        preempted = max(preempted, getattr(engine._seqs.get("t2"), "num_preemptions", 0))
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished() and preempted == 0
    assert kept.runs == {}   # t1 yielded its blocks
    assert tokens["t2"] == greedy_reference(model, p2, 8)
    assert tokens["other"] == greedy_reference(model, list(range(40, 53)), 8)
    assert engine.num_free_blocks == 17
