"""A split request's master needs blocks for its output (issue #25): why the dispatcher keeps
its output room booked until it ends (serve/elastic_dispatch.py, ``ElasticRouting.arrived``).

Request a is split [0, 8) on instance 1 and [8, 16) on instance 0, its master, which appends
its 8 output tokens (positions 16..23: two more blocks of 4). Whole requests are protected by
preemption: when a decode needs a block, the newest running sequence gives its blocks back and
is recomputed later. A master cannot be recomputed where it is (its earlier KV is elsewhere),
so the batcher raises; and a request whose KV is still in flight (reserved, not running) holds
its blocks out of reach of preemption. So:

- room given away: request b reserves every free block of instance 0 while its KV is in flight;
  a's next token finds no block and the round fails (no world needed: it fails scheduling);
- the same with a whole request in a's place: b's blocks are again out of reach, but the
  whole request is preempted (recomputed later) and the step goes on;
- room kept (what the router now allows): b gets only the blocks beyond a's output, and a
  (over the two instances, an ``ElasticRows`` on each, joined by a ``SocketWorld``) and b decode
  in the same rounds; both equal the single engine's tokens and logprobs;
- room kept, but a whole request w admitted before a grows into it (whole requests' output is
  not booked): a is the newest running sequence, so the batcher's victim would be a itself;
  ``ElasticRows.round`` preempts w instead (engine/master_room.py), w is recomputed once the
  in-flight request is gone, and a's and w's tokens equal the engine's.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from engine_helpers import TINY
from exactness import TOP, assert_same_run, logprobs_of_logits
from test_elastic_handover import _kv_of
from tetris.actors.decode.elastic_link import SocketWorld
from tetris.kernels.paged_decode import write_kv

from tetris.engine.block_manager import OutOfBlocksError
from tetris.engine.elastic_rows import ElasticRows
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

BS, KEY, SPLIT, BLOCKS = 4, 3, 8, 6
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=TOP)
B_PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=TOP)
# a's range on its master [8, 16) and its output: (16 - 8 + 8) / 4 = 4 of instance 0's 6 blocks
A_BLOCKS = (16 - SPLIT + PARAMS.max_tokens) // BS


def _prompts():
    gen = torch.Generator().manual_seed(25)
    return {rid: torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist()
            for rid, n in (("a", 16), ("b", 4), ("w", 7))}


def _hand_off(engine, model, rid, prompt, kv_start=0, params=PARAMS):
    """Stand-in for the prefill's streaming: ``prompt``'s KV from ``kv_start`` written into
    the blocks reserved for it, then its first token committed."""
    kv, row = _kv_of(model, prompt)
    table = engine.reserve_blocks(rid, prompt, params, kv_start=kv_start)
    slots = torch.tensor([table[(p - kv_start) // BS] * BS + (p - kv_start) % BS
                          for p in range(kv_start, len(prompt))])
    for layer, (k, v) in enumerate(kv):
        write_kv(engine.cache.k[layer], engine.cache.v[layer], k[kv_start:], v[kv_start:], slots)
    first = int(row.argmax())
    engine.commit_prefilled(rid, first, logprobs_of_logits([row], [first])[0])


@pytest.mark.parametrize("kv_start", [SPLIT, 0])
def test_a_decode_whose_blocks_were_given_away(kv_start):
    model, tok = load_model(TINY)
    engine = LLMEngine(model, tok, num_blocks=BLOCKS, block_size=BS)
    prompts = _prompts()
    _hand_off(engine, model, "a", prompts["a"], kv_start)
    # b's KV in flight: every free block reserved, out of reach of preemption
    engine.reserve_blocks("b", [1] * (engine.num_free_blocks * BS - 1), PARAMS)
    assert engine.num_free_blocks == 0
    steps = PARAMS.max_tokens   # a's output needs a block within these
    if kv_start:   # the master: the round fails
        with pytest.raises(OutOfBlocksError, match="master cannot be preempted"):
            for _ in range(steps):
                engine.step()
        return
    # a whole request gives its blocks back instead (recomputed once blocks free up)
    seq = engine._seqs["a"]
    for _ in range(steps):
        engine.step()
        if seq.num_preemptions:
            break
    assert seq.num_preemptions == 1 and engine.batcher.waiting[0] is seq


def _member(index: int, store, out: dict, grow: bool = False) -> None:
    model, tok = load_model(TINY)
    blocks = BLOCKS_GROW if grow and index == 0 else BLOCKS
    engine = LLMEngine(model, tok, num_blocks=blocks, block_size=BS)
    elastic = ElasticRows(engine, index, 2, SocketWorld(store, index, 2))
    prompts = _prompts()
    a = prompts["a"]
    if index == 1:   # holder of [0, SPLIT)
        kv, _ = _kv_of(model, a)
        shard = elastic.hold("a", KEY, 0, 0, SPLIT)
        for layer, (k, v) in enumerate(kv):
            elastic.holder.write(layer, shard, 0, k[:SPLIT], v[:SPLIT])
    elif grow:       # w first, then a's master, then a request in flight on the router's room
        return _grow(engine, elastic, model, prompts, out)
    else:            # master of [SPLIT, 16), then b on the blocks beyond a's output room
        _hand_off(engine, model, "a", a, SPLIT)
        elastic.master("a", KEY, [1])
        # the router's room now: the blocks beyond a's range and output, for b's prompt and
        # output (a whole request is booked prompt + max_tokens)
        out["room"] = (BLOCKS - A_BLOCKS) * BS
        _hand_off(engine, model, "b", prompts["b"], params=B_PARAMS)
    runs = _run(elastic, GROW_ROUNDS if grow else PARAMS.max_tokens)
    elastic.release("a")
    out[index] = {"runs": runs, "free": engine.num_free_blocks,
                  "unfinished": engine.has_unfinished()}


W_PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=TOP)
GROW_ROUNDS, FREED_AT, BLOCKS_GROW = 30, 6, 12


def _run(elastic, rounds, at=None):
    runs = {}
    for r in range(rounds):
        if at is not None:
            at(r)
        outputs, failed = elastic.round()
        assert not failed, (elastic.index, failed)
        for o in outputs:
            tokens, lps = runs.setdefault(o.request_id, ([], []))
            tokens += o.new_token_ids
            lps += o.new_logprobs
    return runs


def _grow(engine, elastic, model, prompts, out):
    engine.add_request("w", prompts["w"], W_PARAMS)
    first = _run(elastic, 1)                     # w prefills (round 0), a not there yet
    _hand_off(engine, model, "a", prompts["a"], SPLIT)
    elastic.master("a", KEY, [1])
    free = engine.num_free_blocks
    # the router's room: free slots less a's booked output; x takes all of it, in flight
    room = free * BS - PARAMS.max_tokens
    engine.reserve_blocks("x", [1] * (room - 1), SamplingParams(max_tokens=1))
    w = engine._seqs["w"]

    def at(r):   # x's run is aborted after a few rounds (its client left): blocks free again
        if r == FREED_AT:
            assert w.num_preemptions == 1 and engine._seqs["a"].num_preemptions == 0
            engine.abort_request("x")

    runs = _run(elastic, GROW_ROUNDS - 1, at)
    runs["w"] = (first["w"][0] + runs["w"][0], first["w"][1] + runs["w"][1])
    runs.pop("x", None)
    elastic.release("a")
    out[0] = {"runs": runs, "free": engine.num_free_blocks, "unfinished": engine.has_unfinished()}


def _reference(prompts):
    model, tok = load_model(TINY)
    engine = LLMEngine(model, tok, num_blocks=64, block_size=BS)
    runs = {rid: ([], []) for rid in prompts}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, {"b": B_PARAMS, "w": W_PARAMS}.get(rid, PARAMS))
    while engine.has_unfinished():
        for o in engine.step():
            runs[o.request_id][0].extend(o.new_token_ids)
            runs[o.request_id][1].extend(o.new_logprobs)
    return runs


def _world(grow: bool) -> dict:
    store, out, errors = dist.HashStore(), {}, []

    def run(index):
        try:
            _member(index, store, out, grow)
        except Exception as e:  # noqa: BLE001 - reported below with its instance
            errors.append((index, e))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120.0)
    assert not errors and 0 in out and 1 in out, errors
    return out


def test_with_its_output_room_kept_the_master_decodes_the_engines_tokens():
    out = _world(grow=False)
    want = _reference(_prompts())
    assert out["room"] == len(_prompts()["b"]) + B_PARAMS.max_tokens   # b fits what is left
    master = out[0]
    assert sorted(master["runs"]) == ["a", "b"] and out[1]["runs"] == {}
    for rid in ("a", "b"):
        assert_same_run(*master["runs"][rid], want[rid], rid)
    assert master["free"] == BLOCKS and not master["unfinished"]
    assert out[1]["free"] == BLOCKS


def test_a_whole_request_grown_into_the_masters_room_is_preempted_not_the_master():
    out = _world(grow=True)
    want = _reference(_prompts())
    master = out[0]
    assert sorted(master["runs"]) == ["a", "w"] and out[1]["runs"] == {}
    for rid in ("a", "w"):
        assert_same_run(*master["runs"][rid], want[rid], rid)
    assert master["free"] == BLOCKS_GROW and not master["unfinished"]
    assert out[1]["free"] == BLOCKS
