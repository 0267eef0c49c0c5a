"""Elastic decode over three decode instances of TP 2 through the decode rank's commands
(actors/decode/elastic.py), without Ray: six ``DecodeRank`` processes, each instance's two
ranks in their own TP world and lockstep (rank 0 leads every round, ``DecodeRank.round``),
rank r of every instance in elastic world r (``join_elastic``, a ``SocketWorld``). Every
range's KV (the rank's head slice) is streamed by a real ``SendManager`` over the in-process
transfer backend in range-local positions.

Request a is split over all three instances (mastered by 0, ranges on 2 and 1), b over two
(mastered by 1, a range on 2), and c, d, e are unsplit on 0, 1, 2: so instance 1 masters b
and holds part of a, instance 2 masters e and holds parts of a and b, in the same steps. Every
request gives the single TP-1 engine's greedy tokens and logprobs; each rank sends exactly the
q and partials of its head slice per step; after ``Release`` every block is free on every
rank."""

from __future__ import annotations

import json
import os
import time

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from exactness import TOP, assert_same_run, engine_runs
from test_elastic_rank import MODEL, TRANSFER, _Direct, _prefill, _Sender
from tetris.actors.decode.elastic import Hold, Lead, Release, range_transfer_id
from tetris.actors.decode.messages import Commit, Reserve
from tetris.actors.decode.rank import DecodeRank
from tetris.actors.prefill.world import free_port

from tetris.config import DecodeConfig, DeploymentConfig
from tetris.engine.engine import LLMEngine
from tetris.engine.request import TokenLogprob
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

TP, INSTANCES = 2, 3
BLOCKS, BS = 24, 4
DEPLOYMENT = DeploymentConfig(model=MODEL, decode=DecodeConfig(
    tp_size=TP, max_batch_size=4, block_size=BS, kv_blocks=BLOCKS))
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=TOP)
ROUNDS = 10
# request -> [(instance, start, end)] tiling its prompt; the last range's instance masters it
PLACEMENTS = {"a": [(2, 0, 10), (1, 10, 21), (0, 21, 33)], "b": [(2, 0, 12), (1, 12, 27)],
              "c": [(0, 0, 19)], "d": [(1, 0, 13)], "e": [(2, 0, 15)]}
KEYS = {"a": 1, "b": 2}


def _prompts():
    g = torch.Generator().manual_seed(11)
    return {rid: torch.randint(0, MODEL.vocab_size, (ranges[-1][2],), generator=g).tolist()
            for rid, ranges in PLACEMENTS.items()}


def _commands(me: int, prompts):
    """Round 0's reservations on instance ``me``, the ranges it is sent, round 1's commits."""
    reserve, sends, commits = [], [], []
    for rid, ranges in PLACEMENTS.items():
        master, kv_start, _ = ranges[-1]
        for inst, s, e in ranges[:-1]:
            if inst == me:
                reserve.append(Hold(rid, KEYS[rid], master, s, e))
                sends.append((range_transfer_id(rid, s), rid, s, e))
        if master == me:
            reserve.append(Reserve(rid, tuple(prompts[rid]), PARAMS, kv_start=kv_start))
            if kv_start:
                reserve.append(Lead(rid, KEYS[rid], tuple(i for i, _, _ in ranges[:-1])))
            sends.append((rid, rid, kv_start, len(prompts[rid])))
            commits.append(rid)
    return reserve, sends, commits


def _worker(proc: int, tp_ports: list[int], world_ports: list[int], tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    me, tp_rank = divmod(proc, TP)
    rank = DecodeRank(me, tp_rank, TP, DEPLOYMENT)
    rank.init_group("127.0.0.1", tp_ports[me], 60.0)
    info = rank.enable_transfer(TRANSFER)
    sender = _Sender(tp_rank)   # a sender id within the transfer config's prefill pool
    try:
        sender.agent.add_peer(info)
        rank.connect_senders({tp_rank: _Direct(sender)})
        sender.pump.connect({rank.receiver_id: _Direct(rank)})
        rank.join_elastic(me, INSTANCES, "127.0.0.1", world_ports[tp_rank], 60.0,
                          listen_host="127.0.0.1")
        model, _ = load_model(MODEL)
        prompts = _prompts()
        reserve, sends, commits = _commands(me, prompts)
        prefills = {rid: _prefill(model, prompts[rid]) for rid in PLACEMENTS}
        heads = slice(tp_rank * MODEL.num_kv_heads // TP, (tp_rank + 1) * MODEL.num_kv_heads // TP)
        replies = [rank.round(reserve)] if tp_rank == 0 else []
        # rank 0's round 0 reserved the blocks on both ranks: a handshake now finds them
        dist.barrier()
        for tid, rid, s, e in sends:   # this rank's head slice of each range it keeps
            sender.send(tid, rank.receiver_id, [kv[s:e, :, heads] for kv in prefills[rid][0]])
        deadline = time.monotonic() + 60.0
        while rank.held().receiving:   # the pump thread places the pieces; no round needed
            assert time.monotonic() < deadline, rank.held()
            time.sleep(0.01)
        # both ranks have every range of this instance: the commits may go (a master's first
        # exchange waits for its holders' round 1, which follows their own barrier)
        dist.barrier()
        if tp_rank == 0:
            replies.append(rank.round([Commit(rid, prefills[rid][1], prefills[rid][2])
                                       for rid in commits]))
            replies += [rank.round([]) for _ in range(ROUNDS)]
            replies.append(rank.round([Release(rid) for rid in KEYS]))
        else:
            assert rank._follower.join(120.0), "rank 0 never stopped the lockstep"
        _write(tmp, proc, rank, replies)
    finally:
        sender.pump.stop()
        rank.shutdown()


def _write(tmp: str, proc: int, rank: DecodeRank, replies) -> None:
    """Rank 0: its instance's outputs and every rank's last stats; each rank: its bytes."""
    runs = {}
    for reply in (r[0] for r in replies):
        for d in reply.outputs:
            tokens, lps = runs.setdefault(d.request_id, ([], []))
            tokens += d.new_token_ids
            lps += [msgspec.to_builtins(lp) for lp in d.new_logprobs]
    out = {"runs": runs, "data": rank.elastic.rows.counts.data,
           "rejected": [x.request_id for rs in replies for r in rs for x in r.rejected],
           "failed": [x.request_id for rs in replies for r in rs for x in r.failed],
           "last": [msgspec.to_builtins(r.stats) for r in replies[-1]] if replies else []}
    out["free"] = rank.held().free_blocks   # idle now: rank 0's last round has ended
    with open(f"{tmp}/proc{proc}.json", "w") as f:
        json.dump(out, f)


def test_three_tp2_instances_decode_requests_split_over_three_and_two(tmp_path):
    tp_ports = [free_port() for _ in range(INSTANCES)]
    world_ports = [free_port() for _ in range(TP)]
    mp.spawn(_worker, args=(tp_ports, world_ports, str(tmp_path)), nprocs=INSTANCES * TP)
    model, tok = load_model(MODEL)
    prompts = _prompts()
    engine = LLMEngine(model, tok, num_blocks=64, block_size=BS)
    want = dict(zip(prompts, engine_runs(engine, list(prompts.values()), PARAMS), strict=True))
    hq, d = MODEL.num_heads // TP, MODEL.hidden_size // MODEL.num_heads
    q, part = hq * d * 4, hq * d * 4 + hq * 4       # one row's q; its (out, LSE) partial
    # per decode step, each instance's sends: 0 asks 2 and 1 about a; 1 answers a and asks 2
    # about b; 2 answers a (to 0) and b (to 1)
    per_step = {0: 2 * q, 1: q + part, 2: 2 * part}
    for proc in range(INSTANCES * TP):
        me, tp_rank = divmod(proc, TP)
        got = json.loads((tmp_path / f"proc{proc}.json").read_text())
        assert got["data"] == (PARAMS.max_tokens - 1) * MODEL.num_layers * per_step[me], proc
        assert got["free"] == BLOCKS, proc
        if tp_rank:
            continue
        assert got["rejected"] == [] and got["failed"] == []
        mine = {rid for rid, ranges in PLACEMENTS.items() if ranges[-1][0] == me}
        assert set(got["runs"]) == mine
        for rid in sorted(mine):
            tokens, entries = got["runs"][rid]
            lps = [msgspec.convert(e, TokenLogprob) for e in entries]
            assert_same_run(tokens, lps, want[rid], f"instance {me} {rid}")
        # both ranks of the instance: every block free after the release, nothing running
        assert [(s["free_blocks"], s["running"]) for s in got["last"]] == [(BLOCKS, 0)] * TP
