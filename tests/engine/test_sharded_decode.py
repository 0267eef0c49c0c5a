"""Multi-master decode over KV shards (tetris/engine/sharded_decode.py) on the seeded tiny
model: requests split over 2 and 3 holders, beside unsplit ones in the same steps, give the
single engine's greedy tokens; a split that moves as tokens are appended too; the bytes a
step moves are q and the partials, and no KV moves after placement."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import causal_op
from engine_helpers import tiny_model as _load_tiny
from exactness import TOP, assert_same_run, engine_runs, logprobs_of_logits

from tetris.engine.engine import LLMEngine
from tetris.engine.kv_shards import ShardHolder
from tetris.engine.sharded_decode import PartialBatch, QueryBatch, ShardedDecoder
from tetris.sampling_params import SamplingParams

MAX_TOKENS = 12
BS = 4


@pytest.fixture(scope="module")
def tiny_model():
    return _load_tiny()


def _prompts(lengths, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _engine_tokens(model, tok, prompts, max_tokens):
    engine = LLMEngine(model, tok, num_blocks=128, block_size=BS)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in engine.generate(prompts, params)]


def _decoder(model, blocks):
    return ShardedDecoder(model, [ShardHolder(i, model, n, BS) for i, n in enumerate(blocks)])


def _run(decoder, request_ids, model=None):
    """Step until done; with ``model``, check every step's logits against a cache-free
    recompute of the whole sequence (greedy tokens of the tiny model alone are too coarse)."""
    while any(not decoder.requests[r].finished for r in request_ids):
        decoder.step()
        for rid, row in decoder.logits.items() if model is not None else ():
            tokens = decoder.requests[rid].tokens[:-1]
            hidden = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), causal_op)
            ref = model.logits(hidden[-1:])[0]
            torch.testing.assert_close(row.float(), ref, rtol=1e-4, atol=1e-4)
    return [decoder.requests[r].output_token_ids for r in request_ids]


def test_split_over_two_and_three_holders_beside_unsplit_requests(tiny_model):
    model, tok = tiny_model
    prompts = _prompts([37, 21, 9, 14])
    expected = _engine_tokens(model, tok, prompts, MAX_TOKENS)
    dec = _decoder(model, [64, 64, 64])
    placements = {
        "a": [(0, 0, 12), (1, 12, 25), (2, 25, 37)],  # 3 holders, master 2
        "b": [(2, 0, 10), (0, 10, 21)],               # 2 holders, master 0; 2 holds a's tail
        "c": [(1, 0, 9)],                             # unsplit on 1
        "d": [(0, 0, 14)],                            # unsplit on 0, beside b's master
    }
    for (rid, ranges), prompt in zip(placements.items(), prompts, strict=True):
        dec.place_prefilled(rid, prompt, ranges, MAX_TOKENS)
    assert {rid: r.master for rid, r in dec.requests.items()} == {"a": 2, "b": 0, "c": 1, "d": 0}
    dec.step()
    # holder 0 is master for b and d and a holder for a; holder 2 master for a, holder for b
    assert sorted((m.master, m.holder, m.request_ids) for m in dec.traffic
                  if isinstance(m, QueryBatch) and m.layer == 0) == [
        (0, 2, ("b",)), (2, 0, ("a",)), (2, 1, ("a",))]
    assert _run(dec, list(placements), model) == expected
    for rid in list(placements):
        dec.free(rid)
    assert [h.blocks.num_free_blocks for h in dec.holders] == [64, 64, 64]


def test_split_moves_as_tokens_are_appended(tiny_model):
    model, tok = tiny_model
    prompts = _prompts([14, 6], seed=11)
    expected = _engine_tokens(model, tok, prompts, 30)
    # holder 0: 4 blocks (16 slots), holder 1: 3 blocks, holder 2: plenty. Request "long" fills
    # 0 at 16 tokens, moves to the holder with most room (2), ...; "short" lives on 1.
    dec = _decoder(model, [4, 3, 32])
    dec.place_prefilled("long", prompts[0], [(0, 0, 14)], 30)
    dec.place_prefilled("short", prompts[1], [(1, 0, 6)], 30)
    assert _run(dec, ["long", "short"], model) == expected
    long_ranges = [(s.holder, s.start, s.end) for s in dec.requests["long"].shards]
    short_ranges = [(s.holder, s.start, s.end) for s in dec.requests["short"].shards]
    # 14 prompt + 29 appended inputs = 43 tokens with KV; holder 0 keeps its 16.
    assert long_ranges == [(0, 0, 16), (2, 16, 43)]
    # short: 6 + 29 = 35 tokens; holder 1 has 12 slots, then the most free holder is 2.
    assert short_ranges == [(1, 0, 12), (2, 12, 35)]


def test_a_step_moves_q_and_partials_only(tiny_model):
    model, _ = tiny_model
    prompts = _prompts([30, 10, 10], seed=5)
    dec = _decoder(model, [32, 32, 32])
    dec.place_prefilled("split", prompts[0], [(0, 0, 10), (1, 10, 20), (2, 20, 30)], 4)
    dec.place_prefilled("u0", prompts[1], [(0, 0, 10)], 4)
    dec.place_prefilled("u1", prompts[2], [(1, 0, 10)], 4)
    before = [h.cache.buffer.clone() for h in dec.holders]
    dec.step()
    cfg = model.cfg
    elem = 4  # fp32
    q_bytes = cfg.num_heads * cfg.attention_head_dim * elem
    partial_bytes = q_bytes + cfg.num_heads * 4  # out, and the fp32 LSE per head
    holders = 3
    expected = cfg.num_layers * (holders - 1) * (q_bytes + partial_bytes)
    assert sum(m.nbytes for m in dec.traffic) == expected
    assert {m.request_ids for m in dec.traffic} == {("split",)}
    assert sum(isinstance(m, PartialBatch) for m in dec.traffic) == cfg.num_layers * 2
    # The only KV written anywhere is each request's new token, at its master.
    new_slots = {(r.master, dec.holders[r.master].slot(r.shards[-1], r.shards[-1].num_tokens - 1))
                 for r in dec.requests.values()}
    changed = set()
    for h, old in zip(dec.holders, before, strict=True):
        diff = (h.cache.buffer != old).flatten(start_dim=4).any(dim=-1)  # [L, 2, NB, BS]
        for block, offset in diff.any(dim=0).any(dim=0).nonzero().tolist():
            changed.add((h.index, block * BS + offset))
    assert changed == new_slots and len(new_slots) == 3


def test_ranges_must_tile_the_prompt_and_fit(tiny_model):
    model, _ = tiny_model
    dec = _decoder(model, [2, 8])
    with pytest.raises(ValueError, match="tile"):
        dec.place_prefilled("x", list(range(10)), [(0, 0, 4), (1, 5, 10)], 2)
    with pytest.raises(Exception, match="no room"):
        dec.place_prefilled("x", list(range(12)), [(0, 0, 12)], 2)
    assert [h.blocks.num_free_blocks for h in dec.holders] == [2, 8]


def test_a_prompt_larger_than_every_holder_is_served_by_their_sum(tiny_model):
    model, tok = tiny_model
    prompt = _prompts([50], seed=13)[0]
    expected = _engine_tokens(model, tok, [prompt], 20)
    dec = _decoder(model, [8, 8, 8])            # 32 slots each: the 50-token prompt fits none
    assert not any(h.can_hold(50) for h in dec.holders)
    dec.place_prefilled("big", prompt, [(0, 0, 25), (1, 25, 50)], 20)
    assert _run(dec, ["big"], model) == expected
    # 50 + 19 appended = 69 tokens: holder 1 fills its 32 slots, then the freest (2) takes over
    assert [(s.holder, s.start, s.end) for s in dec.requests["big"].shards] == [
        (0, 0, 25), (1, 25, 57), (2, 57, 69)]


def test_abort_mid_decode_frees_every_range_and_the_others_go_on(tiny_model):
    model, tok = tiny_model
    prompts = _prompts([30, 11], seed=17)
    expected = _engine_tokens(model, tok, prompts[1:], 8)
    dec = _decoder(model, [16, 16, 16])
    dec.place_prefilled("gone", prompts[0], [(0, 0, 10), (1, 10, 20), (2, 20, 30)], 8)
    dec.place_prefilled("kept", prompts[1], [(1, 0, 11)], 8)
    dec.step()
    dec.step()
    dec.free("gone")
    assert [h.blocks.num_free_blocks for h in dec.holders] == [16, 12, 16]   # kept: 13 tokens, 4 blocks
    assert _run(dec, ["kept"], model) == expected
    assert dec.traffic == []                              # kept is on one holder: nothing moves


def test_an_engine_holds_a_range_beside_its_own_batch(tiny_model):
    model, tok = tiny_model
    prompts = _prompts([26, 9], seed=19)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=TOP)
    expected = engine_runs(LLMEngine(model, tok, num_blocks=128, block_size=BS), prompts, params)
    engine = LLMEngine(model, tok, num_blocks=32, block_size=BS)
    engine.add_request("own", prompts[1], params)
    dec = ShardedDecoder(model, [ShardHolder(0, model, 32, BS), ShardHolder.of_engine(1, engine)])
    dec.place_prefilled("split", prompts[0], [(1, 0, 13), (0, 13, 26)], 10)
    assert engine.num_free_blocks == 32 - 4             # the engine's pool holds the range
    own, split = ([], []), []
    while engine.has_unfinished() or not dec.requests["split"].finished:
        if dec.step():                                   # the engine's cache answers q ...
            split += logprobs_of_logits([dec.logits["split"]], dec.requests["split"].tokens[-1:])
        for out in engine.step():                        # ... and runs its own request
            own[0].extend(out.new_token_ids)
            own[1].extend(out.new_logprobs)
    tokens = dec.requests["split"].output_token_ids
    # the first token is the (local) prefill's; the sharded steps decode the rest
    assert tokens[:1] == expected[0][0][:1]
    assert_same_run(tokens[1:], split, (expected[0][0][1:], expected[0][1][1:]), "split")
    assert_same_run(*own, expected[1], "the engine's own")
    dec.free("split")
    assert engine.num_free_blocks == 32
