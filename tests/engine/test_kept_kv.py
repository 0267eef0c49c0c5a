"""The decode side of prefix caching on one engine (engine/kept_kv.py): a finished turn's KV is
kept, the next turn shares its prefix's blocks (the boundary block copied), only the rest is written as a prefill would,
and the next turn's greedy tokens equal a cache-free reference; nothing is left after drops."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy_reference, prefill_kv, tiny_model
from tetris.kernels.paged_decode import write_kv

from tetris.engine.engine import LLMEngine
from tetris.engine.kept_kv import KeptKV
from tetris.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prefill_kv(model, prompt):
    kv, row = prefill_kv(model, prompt)
    return kv, int(row[0].argmax(-1))


def _run(engine, rid):
    out = []
    while engine.has_unfinished():
        out += [o for o in engine.step() if o.request_id == rid]
    return out


def test_a_second_turn_reads_the_first_turns_kept_kv_and_stays_exact():
    model, tok = tiny_model()
    engine = LLMEngine(model, tok, num_blocks=48, block_size=4)
    kept = KeptKV(engine)
    p1 = [(i * 7) % 300 + 5 for i in range(30)]
    kept.want("t1")
    engine.add_request("t1", p1, GREEDY)
    out1 = list(_run(engine, "t1")[-1].token_ids)
    assert out1 == greedy_reference(model, p1, 8)
    # the last output token's KV was never computed: prompt and 7 outputs are kept
    assert kept.tokens("t1") == len(p1) + 7 and engine.num_free_blocks == 48 - 10
    p2 = p1 + out1 + [11, 12, 13, 14, 15]
    reuse = len(p1) + 5    # ends inside a block (4 tokens a block): the boundary is copied too
    assert kept.covers("t1", p2, reuse) and kept.covers("t1", p2, len(p1) + 7)
    assert not kept.covers("t1", p2, len(p1) + 8)                  # past the kept KV
    assert not kept.covers("t1", [p1[0] + 1] + p2[1:], reuse)      # other tokens
    shared = kept.shared_blocks("t1", reuse)
    table = engine.reserve_blocks("t2", p2, GREEDY, shared=shared)
    kept.copy_boundary("t1", table, reuse)
    kv, first = _prefill_kv(model, p2)
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(len(p2))])
    for layer, (k, v) in enumerate(kv):   # the rest, as the prefill streams it
        write_kv(engine.cache.k[layer], engine.cache.v[layer], k[reuse:], v[reuse:],
                 slots[reuse:])
        got_k, _ = engine.cache.gather(layer, slots[:reuse])
        # the kept KV was computed by decode steps, the reference by one prefill: fp32 close
        assert torch.allclose(got_k, k[:reuse], atol=1e-5), layer
    engine.commit_prefilled("t2", first)
    assert list(_run(engine, "t2")[-1].token_ids) == greedy_reference(model, p2, 8)
    assert kept.drop("t1") and not kept.drop("t1")
    assert engine.num_free_blocks == 48 and kept.runs == {}


def test_kept_runs_make_room_for_a_request_earliest_first():
    model, tok = tiny_model()
    engine = LLMEngine(model, tok, num_blocks=16, block_size=4)
    kept = KeptKV(engine)
    for rid, base in (("a", 5), ("b", 40), ("c", 80)):   # 10 + 8 tokens: 5 blocks each
        kept.want(rid)
        engine.add_request(rid, list(range(base, base + 10)), GREEDY)
        _run(engine, rid)
    assert list(kept.runs) == ["a", "b", "c"] and engine.num_free_blocks == 1
    assert kept.make_room(2) == [] and kept.runs.keys() == {"a", "b", "c"}   # 1 block fits
    # 19 tokens (and the first output) need 5 blocks: "a" is spared (a prefix being copied),
    # "b" goes first
    assert kept.make_room(19, spare="a") == ["b"] and engine.can_reserve(19)
    assert kept.make_room(60) == ["a", "c"] and engine.num_free_blocks == 16


def test_aborted_runs_are_not_kept_and_a_missing_prefix_is_refused():
    model, tok = tiny_model()
    engine = LLMEngine(model, tok, num_blocks=16, block_size=4)
    kept = KeptKV(engine)
    kept.want("a")
    engine.add_request("a", list(range(5, 15)), GREEDY)
    engine.step()
    engine.abort_request("a")
    _run(engine, "a")
    assert kept.runs == {} and engine.num_free_blocks == 16
    table = engine.reserve_blocks("b", list(range(5, 15)), GREEDY)
    with pytest.raises(ValueError, match="no kept KV"):
        kept.copy_boundary("a", table, 4)
    engine.abort_request("b")
    assert engine.num_free_blocks == 16
