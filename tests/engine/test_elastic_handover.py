"""A split that moves as tokens are appended, in running engines (engine/elastic_handover.py):
three decode instances (TP 1, one thread each, an ``ElasticRows`` on each engine, joined by the
decode ranks' ``SocketWorld``). Request a is handed off as [0, 8) on instance 2, [8, 16) on
1 and [16, 30) on 0, its master, with the line (1, 2). Instance 0 has blocks for a's range
and c only: when a's next token needs a new block, 1 becomes master without any KV moving;
1 has room for one block of a beside d, so 2 becomes master next. c, d and e are unsplit
requests on 0, 1 and 2 decoding in the same rounds. a's tokens, logprobs and text (joined
across the instances that streamed it) equal the single engine's; each range's KV sits on
the instance that computed it and equals the model's; every block comes back."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from engine_helpers import TINY
from exactness import TOP, assert_same_run, logprobs_of_logits
from tetris.actors.decode.elastic_link import SocketWorld
from tetris.kernels import dispatch
from tetris.kernels.paged_decode import write_kv

from tetris.engine.elastic_rows import ElasticRows
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

BS, KEY, ROUNDS = 4, 7, 22
A_RANGES = [(2, 0, 8), (1, 8, 16), (0, 16, 30)]
# instance -> (blocks, its unsplit request, the round it is added, prompt length, max tokens)
# 0: a's [16, 32) and c's 4 blocks; 1: a's [8, 16), one block of a and d's 4; 2: the rest
INSTANCES = {0: (8, "c", 0, 12, 5), 1: (7, "d", 3, 12, 5), 2: (9, "e", 8, 12, 5)}
A_PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=TOP)


def _params(rid):
    return A_PARAMS if rid == "a" else SamplingParams(
        max_tokens=INSTANCES[{"c": 0, "d": 1, "e": 2}[rid]][4], temperature=0.0,
        ignore_eos=True, logprobs=TOP)


def _prompts():
    gen = torch.Generator().manual_seed(17)
    lengths = {"a": A_RANGES[-1][2], **{v[1]: v[3] for v in INSTANCES.values()}}
    return {rid: torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist()
            for rid, n in sorted(lengths.items())}


@torch.inference_mode()
def _kv_of(model, tokens):
    """Per layer (k, v) [T, Hkv, D] of ``tokens`` and the logits row after the last one."""
    kv = []

    def attention(layer, q, k, v):
        kv.append((k, v))
        return dispatch.attention_with_lse(q, k, v, causal=True)[0]

    hidden = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), attention)
    return kv, model.logits(hidden[-1:], upcast=True)[0]


def _hand_off(engine, elastic, model, prompt):
    """Stand-in for the prefill's streaming of a's ranges (rows/ranks: test_elastic_rows)."""
    kv, row = _kv_of(model, prompt)
    master, start, _ = A_RANGES[-1]
    for inst, s, e in A_RANGES[:-1]:
        if inst == elastic.index:
            shard = elastic.hold("a", KEY, master, s, e - s)
            for layer, (k, v) in enumerate(kv):
                elastic.holder.write(layer, shard, 0, k[s:e], v[s:e])
            elastic.heir("a", KEY, prompt, A_PARAMS)
    if master == elastic.index:
        table = engine.reserve_blocks("a", prompt, A_PARAMS, kv_start=start)
        slots = torch.tensor([table[(p - start) // BS] * BS + (p - start) % BS
                              for p in range(start, len(prompt))])
        for layer, (k, v) in enumerate(kv):
            write_kv(engine.cache.k[layer], engine.cache.v[layer], k[start:], v[start:], slots)
        first = int(row.argmax())
        engine.commit_prefilled("a", first, logprobs_of_logits([row], [first])[0])
        elastic.master("a", KEY, [i for i, _, _ in A_RANGES[:-1]], line=(1, 2))


def _member(index: int, store, out: dict) -> None:
    model, tok = load_model(TINY)
    blocks, rid, joins, _, _ = INSTANCES[index]
    engine = LLMEngine(model, tok, num_blocks=blocks, block_size=BS)
    elastic = ElasticRows(engine, index, len(INSTANCES), SocketWorld(store, index, 3))
    prompts = _prompts()
    _hand_off(engine, elastic, model, prompts["a"])
    runs = {}
    for r in range(ROUNDS):
        if r == joins:
            engine.add_request(rid, prompts[rid], _params(rid))
        outputs, failed = elastic.round()
        assert not failed, (index, r, failed)
        for o in outputs:
            tokens, lps, text, rounds = runs.setdefault(o.request_id, ([], [], [], []))
            tokens += o.new_token_ids
            lps += o.new_logprobs
            text.append(o.new_text)
            rounds += [r] * len(o.new_token_ids)
    held = [(s.start, s.end, _read(engine, s.block_table, s.num_tokens))
            for h in elastic._held.values() for s in h.shards]
    elastic.release("a")
    out[index] = {"runs": runs, "handovers": elastic.handovers, "held": held,
                  "free": engine.num_free_blocks, "unfinished": engine.has_unfinished()}


def _read(engine, table, n):
    """A range's KV per layer as written in the cache: (k, v) [n, Hkv, D]."""
    slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(n)])
    return [(engine.cache.k[layer].view(-1, *engine.cache.k[layer].shape[2:])[slots],
             engine.cache.v[layer].view(-1, *engine.cache.v[layer].shape[2:])[slots])
            for layer in range(engine.cache.num_layers)]


def _reference(prompts):
    """The single engine: each request's tokens, logprobs and text, all in one batch."""
    model, tok = load_model(TINY)
    engine = LLMEngine(model, tok, num_blocks=128, block_size=BS)
    runs = {rid: ([], [], []) for rid in prompts}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, _params(rid))
    while engine.has_unfinished():
        for o in engine.step():
            runs[o.request_id][0].extend(o.new_token_ids)
            runs[o.request_id][1].extend(o.new_logprobs)
            runs[o.request_id][2].append(o.new_text)
    return model, runs


def test_a_full_master_hands_over_to_the_next_in_line_without_moving_kv():
    store, out, errors = dist.HashStore(), {}, []

    def run(index):
        try:
            _member(index, store, out)
        except Exception as e:  # noqa: BLE001 - reported below with its instance
            errors.append((index, e))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in INSTANCES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120.0)
    assert not errors and len(out) == 3, errors
    prompts = _prompts()
    model, want = _reference(prompts)
    # 0 ran out at a's 33rd token (position 32 needs a fifth block), 1 at position 36
    assert out[0]["handovers"] == [("a", 0, 1, 32)]
    assert out[1]["handovers"] == [("a", 1, 2, 36)] and out[2]["handovers"] == []
    streamed = {0: [], 1: [], 2: []}
    for index, got in out.items():
        assert got["free"] == INSTANCES[index][0] and not got["unfinished"], index
        for rid, (tokens, lps, text, rounds) in got["runs"].items():
            if rid != "a":
                assert_same_run(tokens, lps, want[rid][:2], f"instance {index} {rid}")
                assert "".join(text) == "".join(want[rid][2])
                streamed[index] += rounds   # the unsplit request decoded beside a's rows
        streamed[index] = sorted(set(streamed[index]) & set(got["runs"]["a"][3]))
    assert all(streamed.values()), streamed
    # a: the three instances' outputs in order are the engine's run, text included
    a = [out[i]["runs"]["a"] for i in (0, 1, 2)]
    assert [len(x[0]) for x in a] == [3, 4, 9]   # 30, 31 | 32..35 | 36..44 (+ first token)
    assert_same_run([t for x in a for t in x[0]], [lp for x in a for lp in x[1]], want["a"][:2],
                    "a")
    assert "".join("".join(x[2]) for x in a) == "".join(want["a"][2])
    # each range's KV stayed where it was computed and is the model's KV of those positions
    kv, _ = _kv_of(model, prompts["a"] + want["a"][0][:-1])
    ranges = sorted((s, e, i) for i, got in out.items() for s, e, _ in got["held"])
    assert ranges == [(0, 8, 2), (8, 16, 1), (16, 32, 0), (32, 36, 1)]
    for got in out.values():
        for s, e, layers in got["held"]:
            for (k, v), (k_want, v_want) in zip(layers, kv, strict=True):
                torch.testing.assert_close(k, k_want[s:e], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v, v_want[s:e], rtol=1e-5, atol=1e-5)
