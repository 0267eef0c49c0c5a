"""Multi-master decode with tensor parallelism: every holder is a TP-2 instance (two gloo
ranks in two processes, each rank holding its KV-head slice of every holder's cache), and rank
r of a master exchanges its q-head slice with rank r of each holder. Requests split over 3 and
2 holders beside an unsplit one give the single (TP-1) engine's greedy tokens on both ranks,
every decoded token's logprobs close to the engine's (tokens alone miss a dropped partial), and
each rank's step moves exactly its head slice of q and of the partials."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_helpers import TINY
from engine_helpers import tiny_model as _load_tiny
from exactness import TOP, assert_same_run, engine_runs, logprobs_of_logits

from tetris.engine.engine import LLMEngine
from tetris.engine.kv_shards import ShardHolder
from tetris.engine.request import TokenLogprob
from tetris.engine.sharded_decode import ShardedDecoder
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

MAX_TOKENS = 10
PLACEMENTS = {"a": [(0, 0, 11), (1, 11, 22), (2, 22, 33)],
              "b": [(2, 0, 9), (0, 9, 19)],
              "c": [(1, 0, 13)]}


def _prompts():
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (33, 19, 13)]


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        model, _ = load_model(TINY, tp_group=dist.group.WORLD)
        assert model.local_num_kv_heads * 2 == TINY.num_kv_heads
        dec = ShardedDecoder(model, [ShardHolder(i, model, 32, 4) for i in range(3)])
        for (rid, ranges), prompt in zip(PLACEMENTS.items(), _prompts(), strict=True):
            dec.place_prefilled(rid, prompt, ranges, MAX_TOKENS)
        step_bytes = []
        logprobs = {rid: [] for rid in PLACEMENTS}   # of the tokens the sharded steps decode
        while any(not r.finished for r in dec.requests.values()):
            dec.step()
            step_bytes.append(sum(m.nbytes for m in dec.traffic))
            for rid, row in sorted(dec.logits.items()):
                (lp,) = logprobs_of_logits([row], [dec.requests[rid].tokens[-1]])
                logprobs[rid].append([lp.token_id, lp.logprob, [list(t) for t in lp.top]])
        out = {"tokens": {rid: r.output_token_ids for rid, r in dec.requests.items()},
               "logprobs": logprobs,
               "first_step_bytes": step_bytes[0],
               "cache_heads": dec.holders[0].cache.buffer.shape[-2]}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def test_tp2_holders_exchange_head_slices_and_keep_the_tokens(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    model, tok = _load_tiny()
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP)
    runs = engine_runs(engine, _prompts(), params)
    expected = [tokens for tokens, _ in runs]
    d = TINY.hidden_size // TINY.num_heads
    local_q = (TINY.num_heads // 2) * d * 4                      # fp32 head slice of q
    # a: 2 other holders, b: 1, c: 0; each: q out, (out, LSE) back, per layer
    want_bytes = TINY.num_layers * (2 + 1) * (local_q + local_q + (TINY.num_heads // 2) * 4)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [got["tokens"][rid] for rid in PLACEMENTS] == expected
        for rid, (tokens, entries) in zip(PLACEMENTS, runs, strict=True):
            # the first token is the (local) prefill's; the sharded steps decode the rest
            decoded = [TokenLogprob(t, v, tuple(map(tuple, top)))
                       for t, v, top in got["logprobs"][rid]]
            assert_same_run([e.token_id for e in decoded], decoded, (tokens[1:], entries[1:]),
                            f"rank {rank} {rid}")
        assert got["first_step_bytes"] == want_bytes
        assert got["cache_heads"] == 1                          # one of the two KV heads
