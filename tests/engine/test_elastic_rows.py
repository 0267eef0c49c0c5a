"""Elastic decode inside running engines (tetris/engine/elastic_rows.py): two decode instances,
TP 2 each (four processes; rank r of each instance in a gloo group of its own for the exchange),
each running its own ``LLMEngine`` batch. Request a is mastered by instance 0 with its first 15
tokens held by instance 1, b the other way round; c and d are unsplit, e joins instance 1 mid
generation (its prefill runs in the same forward as b's sharded decode rows). Every request
gives the single TP-1 engine's greedy tokens and logprobs; each round moves exactly q and the
partials of the sharded rows (plus a header of row counts and keys), and no KV moves after the
hand-off (the held ranges' blocks are unchanged); every block comes back."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_helpers import TINY
from engine_helpers import tiny_model as _load_tiny
from exactness import TOP, assert_same_run, engine_runs, logprobs_of_logits
from tetris.kernels import dispatch
from tetris.kernels.paged_decode import write_kv

from tetris.engine.elastic_rows import ElasticRows
from tetris.engine.engine import LLMEngine
from tetris.engine.request import TokenLogprob
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

TP = 2
MAX_TOKENS = 10
ROUNDS = 16          # every rank runs the same rounds; the last ones are idle (headers only)
E_JOINS = 3          # round in which e is added to instance 1
BLOCKS, BS = 48, 4
# request -> [(instance, start, end)] tiling its prompt; the last range's instance is master
PLACEMENTS = {"a": [(1, 0, 15), (0, 15, 33)], "b": [(0, 0, 10), (1, 10, 27)],
              "c": [(0, 0, 19)], "d": [(1, 0, 13)]}
KEYS = {"a": 1, "b": 2}


def _prompts():
    gen = torch.Generator().manual_seed(5)
    return {rid: torch.randint(0, 256, (n,), generator=gen).tolist()
            for rid, n in zip("abcde", (33, 27, 19, 13, 17), strict=True)}


def _params():
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)


class _GlooPeers:
    """Rank r of every instance: a gloo group of its own beside the instance's TP world."""

    def __init__(self, path: str, index: int, size: int) -> None:
        self.group = dist.ProcessGroupGloo(dist.FileStore(path, size), index, size,
                                           timedelta(seconds=60))

    def isend(self, tensor, peer, tag):
        return self.group.send([tensor], peer, tag)

    def irecv(self, tensor, peer, tag):
        return self.group.recv([tensor], peer, tag)


@torch.inference_mode()
def _hand_off(engine, elastic, model, rid, prompt, ranges, generated=()):
    """Stand-in for the prefill's streaming: compute the prompt's KV (this rank's heads) and
    keep each range only on its instance; the master commits the first token. ``generated``:
    a resumed request (its KV computed with the prompt's, as the resume path does)."""
    kv = []
    prompt, full = list(prompt), list(prompt) + list(generated)

    def attention(layer, q, k, v):
        kv.append((k, v))
        return dispatch.attention_with_lse(q, k, v, causal=True)[0]

    hidden = model.forward(torch.tensor(full), torch.arange(len(full)), attention)
    row = model.logits(hidden[-1:], upcast=True)[0]
    first = int(row.argmax())
    master, start, _ = ranges[-1]
    holders = [inst for inst, _, _ in ranges[:-1]]
    held = []
    for inst, s, e in ranges[:-1]:
        if inst == elastic.index:
            shard = elastic.hold(rid, KEYS[rid], master, s, e - s)
            for layer, (k, v) in enumerate(kv):
                elastic.holder.write(layer, shard, 0, k[s:e], v[s:e])
            held.append(shard)
    if master == elastic.index:
        table = engine.reserve_blocks(rid, prompt, _params(), generated, kv_start=start)
        slots = torch.tensor([table[(p - start) // BS] * BS + (p - start) % BS
                              for p in range(start, len(full))])
        for layer, (k, v) in enumerate(kv):
            write_kv(engine.cache.k[layer], engine.cache.v[layer], k[start:], v[start:], slots)
        engine.commit_prefilled(rid, first, logprobs_of_logits([row], [first])[0])
        if holders:
            elastic.master(rid, KEYS[rid], holders)
    return held


def _blocks_of(engine, shards):
    ids = torch.tensor([b for s in shards for b in s.block_table])
    return [t.clone() for layer in range(engine.cache.num_layers)
            for t in (engine.cache.k[layer][ids], engine.cache.v[layer][ids])]


def _worker(rank: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    instance, tp_rank = divmod(rank, TP)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/tp{instance}", TP),
                            rank=tp_rank, world_size=TP)
    try:
        model, _ = load_model(TINY, tp_group=dist.group.WORLD)
        engine = LLMEngine(model, None, num_blocks=BLOCKS, block_size=BS)
        elastic = ElasticRows(engine, instance, 2, _GlooPeers(f"{tmp}/x{tp_rank}", instance, 2))
        prompts = _prompts()
        held = []
        for rid, ranges in PLACEMENTS.items():
            held += _hand_off(engine, elastic, model, rid, prompts[rid], ranges)
        before = _blocks_of(engine, held)
        runs = {rid: [[], []] for rid in "abcde"}
        data, header = [], []
        for r in range(ROUNDS):
            if r == E_JOINS and instance == 1:
                engine.add_request("e", prompts["e"], _params())
            d0, h0 = elastic.counts.data, elastic.counts.header
            outputs = engine.step() if engine.has_unfinished() else []
            elastic.end_step()
            data.append(elastic.counts.data - d0)
            header.append(elastic.counts.header - h0)
            for out in outputs:
                runs[out.request_id][0] += list(out.new_token_ids)
                runs[out.request_id][1] += [[lp.token_id, lp.logprob, [list(t) for t in lp.top]]
                                            for lp in out.new_logprobs]
        unchanged = all(torch.equal(x, y) for x, y in zip(before, _blocks_of(engine, held),
                                                          strict=True))
        for rid in KEYS:
            elastic.release(rid)
        result = {"runs": {k: v for k, v in runs.items() if v[0]}, "data": data,
                  "header": header, "unchanged": unchanged, "unfinished": engine.has_unfinished(),
                  "free": engine.num_free_blocks}
        with open(f"{tmp}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_sharded_rows_decode_beside_the_engines_own_batch(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2 * TP)
    model, tok = _load_tiny()
    prompts = _prompts()
    engine = LLMEngine(model, tok, num_blocks=128, block_size=BS)
    want = dict(zip(prompts, engine_runs(engine, list(prompts.values()), _params()), strict=True))
    hq, d = TINY.num_heads // TP, TINY.hidden_size // TINY.num_heads
    # per sharded row and layer: q out, (out, LSE) back; a's row goes 0 -> 1, b's 1 -> 0
    per_round = TINY.num_layers * (hq * d * 4 + hq * d * 4 + hq * 4)
    for rank in range(2 * TP):
        instance = rank // TP
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        mine = {rid for rid, ranges in PLACEMENTS.items() if ranges[-1][0] == instance}
        mine |= {"e"} if instance == 1 else set()
        assert set(got["runs"]) == mine, rank
        for rid in sorted(mine):
            tokens, entries = got["runs"][rid]
            lps = [TokenLogprob(t, v, tuple(map(tuple, top))) for t, v, top in entries]
            assert_same_run(tokens, lps, want[rid], f"rank {rank} {rid}")
        # rounds 0..MAX_TOKENS-2 decode a and b (their first token came with the hand-off)
        assert got["data"] == [per_round] * (MAX_TOKENS - 1) + [0] * (ROUNDS - MAX_TOKENS + 1)
        # every round: one row count to the peer (8 bytes), and while sharded one key (8)
        assert got["header"] == [16] * (MAX_TOKENS - 1) + [8] * (ROUNDS - MAX_TOKENS + 1)
        assert got["unchanged"] and not got["unfinished"]
        assert got["free"] == BLOCKS


LOST_AFTER = 3       # instance 1 (a's holder, b's master) exits after this many rounds


def _worker_lost(instance: int, tmp: str) -> None:
    """TP 1: instance 1 dies after ``LOST_AFTER`` rounds; instance 0 goes on alone."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    model, _ = load_model(TINY)
    engine = LLMEngine(model, None, num_blocks=BLOCKS, block_size=BS)
    elastic = ElasticRows(engine, instance, 2, _GlooPeers(f"{tmp}/x", instance, 2))
    prompts = _prompts()
    for rid, ranges in PLACEMENTS.items():
        _hand_off(engine, elastic, model, rid, prompts[rid], ranges)
    runs = {rid: [] for rid in "abcde"}
    failed_at = {}
    for r in range(ROUNDS):
        if r == LOST_AFTER and instance == 1:
            os._exit(0)                                  # no goodbye: a crashed instance
        outputs, failed = elastic.round()
        failed_at.update({rid: r for rid in failed})
        for rid in failed:   # the resume path: the client's tokens, the whole KV here
            _hand_off(engine, elastic, model, rid, prompts[rid], [(0, 0, len(prompts[rid]))],
                      generated=runs[rid])
        for out in outputs:
            runs[out.request_id] += list(out.new_token_ids)
    free_before_release = engine.num_free_blocks
    with open(f"{tmp}/lost{instance}.json", "w") as f:
        json.dump({"runs": runs, "failed_at": failed_at, "lost": sorted(elastic.lost),
                   "free": free_before_release, "unfinished": engine.has_unfinished()}, f)


def test_a_lost_holder_fails_its_requests_and_they_resume_whole(tmp_path):
    """Instance 0 masters a (a range on 1) and holds b's range (mastered by 1). Instance 1
    dies: a is failed at the next round with only its correct tokens out, resumes whole on
    instance 0 from them and ends with the engine's tokens; b's range is freed; c goes on."""
    mp.spawn(_worker_lost, args=(str(tmp_path),), nprocs=2)
    model, tok = _load_tiny()
    prompts = _prompts()
    engine = LLMEngine(model, tok, num_blocks=128, block_size=BS)
    want = dict(zip(prompts, engine_runs(engine, list(prompts.values()), _params()), strict=True))
    got = json.loads((tmp_path / "lost0.json").read_text())
    assert got["lost"] == [1] and got["failed_at"] == {"a": LOST_AFTER}
    assert got["runs"]["a"] == want["a"][0] and got["runs"]["c"] == want["c"][0]
    assert got["runs"]["b"] == [] and not got["unfinished"]
    assert got["free"] == BLOCKS                     # b's range went with its master
