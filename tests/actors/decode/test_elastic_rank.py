"""Elastic decode through the decode rank's commands (actors/decode/elastic.py), without Ray:
two TP-1 ``DecodeRank``s in two processes, joined by ``join_elastic`` (a ``SocketWorld``), the
KV of every range streamed by a real ``SendManager`` over the in-process transfer backend in
range-local positions: the master's ``[kv_start, n)`` as the request's transfer
(``Reserve(kv_start=...)``), a held range ``[start, end)`` as ``<id>@<start>`` (``Hold``).
Request a is mastered by instance 0 with tokens [0, 15) on instance 1, b the other way round,
c and d unsplit; every request's deltas give the single engine's tokens and logprobs, and
after ``Release`` nothing is held on either rank."""

from __future__ import annotations

import json
import os

import msgspec
import torch
import torch.multiprocessing as mp
from exactness import TOP, assert_same_run, engine_runs
from ranks import Sender, link, placement_commands, prefill, wait_received
from tetris.actors.decode.elastic import Release
from tetris.actors.decode.messages import Commit
from tetris.actors.decode.rank import DecodeRank
from tetris.actors.prefill.world import free_port

from tetris.config import DecodeConfig, DeploymentConfig, ModelConfig, TransferConfig
from tetris.engine.engine import LLMEngine
from tetris.engine.request import TokenLogprob
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

MODEL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, seed=5)
BLOCKS, BS = 24, 4
DEPLOYMENT = DeploymentConfig(model=MODEL, decode=DecodeConfig(
    tp_size=1, max_batch_size=4, block_size=BS, kv_blocks=BLOCKS))
TRANSFER = TransferConfig(num_backends=2, pool_size=2, backend_buffer_bytes=4096,
                          send_buffer_bytes=4096, bulk_chunk_bytes=4096, timeout_s=20.0,
                          backend="inproc")
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=TOP)
ROUNDS = 10
# request -> [(instance, start, end)], the last range's instance masters it
PLACEMENTS = {"a": [(1, 0, 15), (0, 15, 33)], "b": [(0, 0, 10), (1, 10, 27)],
              "c": [(0, 0, 19)], "d": [(1, 0, 13)]}
KEYS = {"a": 1, "b": 2}


def _prompts():
    g = torch.Generator().manual_seed(9)
    return {rid: torch.randint(0, MODEL.vocab_size, (ranges[-1][2],), generator=g).tolist()
            for rid, ranges in PLACEMENTS.items()}


def transfer_sender(sender_id: int) -> Sender:
    """A prefill instance's transfer side, in range-local positions; a failed transfer is
    forgotten like a sent shard."""
    return Sender(f"prefill-{sender_id}", TRANSFER, sender_id, f"sender-{sender_id}",
                  strict=False)


def _commands(me: int, prompts):
    """Round 0's reservations on instance ``me``, the ranges it is sent, round 1's commits."""
    return placement_commands(me, prompts, PLACEMENTS, KEYS, PARAMS)


def _worker(me: int, port: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    rank = DecodeRank(me, 0, 1, DEPLOYMENT)
    rank.init_group("127.0.0.1", 0, 30.0)
    sender = transfer_sender(me)
    try:
        link(rank, sender, TRANSFER, me)
        rank.join_elastic(me, 2, "127.0.0.1", port, 30.0, listen_host="127.0.0.1")
        model, _ = load_model(MODEL)
        prompts = _prompts()
        reserve, sends, commits = _commands(me, prompts)
        prefills = {rid: prefill(model, prompts[rid]) for rid in PLACEMENTS}
        replies = [rank.step(reserve)]
        for tid, rid, s, e in sends:
            sender.send(tid, rank.receiver_id, [kv[s:e] for kv in prefills[rid][0]])
        wait_received(rank)   # the pump thread places the pieces; no round needed
        # the first exchange of round 1 waits for the peer, whose KV has arrived too
        replies.append(rank.step([Commit(rid, prefills[rid][1], prefills[rid][2])
                                  for rid in commits]))
        replies += [rank.step([]) for _ in range(ROUNDS)]
        replies.append(rank.step([Release(rid) for rid in KEYS]))
        runs = {}
        for reply in replies:
            for d in reply.outputs:
                tokens, lps = runs.setdefault(d.request_id, ([], []))
                tokens += d.new_token_ids
                lps += [msgspec.to_builtins(lp) for lp in d.new_logprobs]
        held = rank.held()
        out = {"runs": runs, "rejected": [r.request_id for x in replies for r in x.rejected],
               "failed": [f.request_id for x in replies for f in x.failed],
               "free": held.free_blocks, "empty": held.engine_requests == 0 and not held.receiving,
               "data": rank.elastic.rows.counts.data}
        with open(f"{tmp}/rank{me}.json", "w") as f:
            json.dump(out, f)
    finally:
        sender.pump.stop()
        rank.shutdown()


def test_elastic_ranks_decode_split_requests_fed_through_the_transfer_layer(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    model, tok = load_model(MODEL)
    prompts = _prompts()
    engine = LLMEngine(model, tok, num_blocks=64, block_size=BS)
    want = dict(zip(prompts, engine_runs(engine, list(prompts.values()), PARAMS), strict=True))
    hq, d = MODEL.num_heads, MODEL.hidden_size // MODEL.num_heads
    per_step = MODEL.num_layers * (hq * d * 4 + hq * d * 4 + hq * 4)  # q out, (out, LSE) back
    for me in range(2):
        got = json.loads((tmp_path / f"rank{me}.json").read_text())
        mine = {rid for rid, ranges in PLACEMENTS.items() if ranges[-1][0] == me}
        assert set(got["runs"]) == mine and got["rejected"] == [] and got["failed"] == []
        for rid in sorted(mine):
            tokens, entries = got["runs"][rid]
            lps = [msgspec.convert(e, TokenLogprob) for e in entries]
            assert_same_run(tokens, lps, want[rid], f"instance {me} {rid}")
        # 7 decode steps of one sharded row each way (the first token came from the prefill)
        assert got["data"] == (PARAMS.max_tokens - 1) * per_step
        assert got["free"] == BLOCKS and got["empty"]
