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
rank.

Then, in the same processes, a split that moves as tokens are appended: h is placed over 1 and
0 (its master, with the line (1,): ``Hold`` gives 1 the prompt and sampling parameters) while
0 also holds a filler range, so 0 has no block for h's position 44: 1 masters h from there
without any KV moving. h's tokens and logprobs, streamed first by 0 and then by 1, are the
engine's, and the bytes of each rank are those of h's q and partials before and after."""

from __future__ import annotations

import json
import os
import random
import socket
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from exactness import TOP, assert_same_run, engine_runs
from ranks import link, placement_commands, prefill
from test_elastic_rank import MODEL, TRANSFER, transfer_sender
from tetris.actors.decode.elastic import Hold, Lead, Release, range_transfer_id
from tetris.actors.decode.messages import Commit, Reserve
from tetris.actors.decode.rank import DecodeRank

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


# the second placement: h split at H_SPLIT, a filler range of F_TOKENS held on 0 (18 blocks)
H_SPLIT, H_TOKENS, F_TOKENS = 20, 40, 72
H_PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=TOP)


def _prompts():
    g = torch.Generator().manual_seed(11)
    lengths = {rid: ranges[-1][2] for rid, ranges in PLACEMENTS.items()}
    return {rid: torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()
            for rid, n in (lengths | {"h": H_TOKENS, "f": F_TOKENS}).items()}


def _commands(me: int, prompts):
    """Round 0's reservations on instance ``me``, the ranges it is sent, round 1's commits."""
    return placement_commands(me, prompts, PLACEMENTS, KEYS, PARAMS)


def _store_ports(n: int) -> list[int]:
    """Ports free now below the kernel's ephemeral range: the stores bind them seconds later,
    and meanwhile every socket bound to port 0 (the lockstep, the socket world, Ray) draws from
    the ephemeral range, where a port picked by ``free_port`` may be taken first."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng, ports = random.Random(), []
    while len(ports) < n:
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def _phase2_commands(me: int, prompts):
    """h over 1 and 0 (master) with the line (1,), and a range f held on 0 (its master never
    asks: it only fills 0, so that h's master range has no block for position 44)."""
    reserve, sends, commits = [], [], []
    if me == 0:
        reserve += [Hold("f", 9, 2, 0, F_TOKENS),
                    Reserve("h", tuple(prompts["h"]), H_PARAMS, kv_start=H_SPLIT),
                    Lead("h", 3, (1,), line=(1,))]
        sends += [(range_transfer_id("f", 0), "f", 0, F_TOKENS), ("h", "h", H_SPLIT, H_TOKENS)]
        commits.append("h")
    if me == 1:
        reserve.append(Hold("h", 3, 0, 0, H_SPLIT, prompt_token_ids=tuple(prompts["h"]),
                            sampling=H_PARAMS))
        sends.append((range_transfer_id("h", 0), "h", 0, H_SPLIT))
    return reserve, sends, commits


def _phase(rank, sender, prefills, commands, releases, after_rounds: int) -> list:
    """One placement's rounds: reserve, stream this rank's head slice of every range, commit,
    decode, release. Rank 0 leads them (its replies returned); rank 1's follower thread steps
    them, so its main thread waits for the reserve round before the TP barrier (no collective
    of its own while its follower steps)."""
    reserve, sends, commits = commands
    tp_rank = rank.tp_rank
    replies = [rank.round(reserve)] if tp_rank == 0 else []
    if tp_rank:
        _wait(lambda: rank._follower.rounds > after_rounds, rank)
    dist.barrier()   # the reserve round ran on both ranks: a handshake now finds the blocks
    heads = slice(tp_rank * MODEL.num_kv_heads // TP, (tp_rank + 1) * MODEL.num_kv_heads // TP)
    for tid, rid, s, e in sends:
        sender.send(tid, rank.receiver_id, [kv[s:e, :, heads] for kv in prefills[rid][0]])
    _wait(lambda: not rank.held().receiving, rank)   # the pump thread places the pieces
    # both ranks have every range of this instance: the commits may go (a master's first
    # exchange waits for its holders' first round, which follows their own barrier)
    dist.barrier()
    if tp_rank == 0:
        replies.append(rank.round([Commit(rid, prefills[rid][1], prefills[rid][2])
                                   for rid in commits]))
        replies += [rank.round([]) for _ in range(ROUNDS)]
        replies.append(rank.round([Release(rid) for rid in releases]))
    return replies


def _wait(done, rank) -> None:
    deadline = time.monotonic() + 60.0
    while not done():
        assert time.monotonic() < deadline, rank.held()
        time.sleep(0.01)


def _worker(proc: int, tp_ports: list[int], world_ports: list[int], tmp: str,
            joined) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    me, tp_rank = divmod(proc, TP)
    rank = DecodeRank(me, tp_rank, TP, DEPLOYMENT)
    rank.init_group("127.0.0.1", tp_ports[me], 60.0)
    sender = transfer_sender(tp_rank)   # a sender id within the transfer config's prefill pool
    try:
        link(rank, sender, TRANSFER, tp_rank)
        rank.join_elastic(me, INSTANCES, "127.0.0.1", world_ports[tp_rank], 60.0,
                          listen_host="127.0.0.1")
        # every rank in its world before any leader sends an elastic command: a follower
        # applies its leader's commands from its lockstep thread, which can run before this
        # thread has joined world 1 (as the served pool joins every rank before serving)
        joined.wait(60.0)
        model, _ = load_model(MODEL)
        prompts = _prompts()
        prefills = {rid: prefill(model, prompt) for rid, prompt in prompts.items()}
        replies = _phase(rank, sender, prefills, _commands(me, prompts), KEYS, 0)
        data = rank.elastic.rows.counts.data
        replies2 = _phase(rank, sender, prefills, _phase2_commands(me, prompts), ("h", "f"),
                          ROUNDS + 3)
        if tp_rank:
            assert rank._follower.join(120.0), "rank 0 never stopped the lockstep"
            data = None   # its follower may have stepped on into the second placement
        _write(tmp, proc, rank, replies, replies2, data)
    finally:
        sender.pump.stop()
        rank.shutdown()


def _runs(replies) -> dict:
    runs = {}
    for reply in (r[0] for r in replies):
        for d in reply.outputs:
            tokens, lps = runs.setdefault(d.request_id, ([], []))
            tokens += d.new_token_ids
            lps += [msgspec.to_builtins(lp) for lp in d.new_logprobs]
    return runs


def _write(tmp: str, proc: int, rank: DecodeRank, replies, replies2, data) -> None:
    """Rank 0: its instance's outputs and every rank's last stats; each rank: its bytes."""
    both = replies + replies2
    out = {"runs": _runs(replies), "runs2": _runs(replies2), "data": data,
           "data_total": rank.elastic.rows.counts.data, "handovers": rank.elastic.rows.handovers,
           "rejected": [x.request_id for rs in both for r in rs for x in r.rejected],
           "failed": [x.request_id for rs in both for r in rs for x in r.failed],
           "last": [msgspec.to_builtins(r.stats) for r in both[-1]] if both else []}
    out["free"] = rank.held().free_blocks   # idle now: rank 0's last round has ended
    with open(f"{tmp}/proc{proc}.json", "w") as f:
        json.dump(out, f)


def test_three_tp2_instances_decode_split_requests_and_a_full_master_hands_over(tmp_path):
    ports = _store_ports(INSTANCES + TP)
    tp_ports, world_ports = ports[:INSTANCES], ports[INSTANCES:]
    joined = mp.get_context("spawn").Barrier(INSTANCES * TP)
    mp.spawn(_worker, args=(tp_ports, world_ports, str(tmp_path), joined),
             nprocs=INSTANCES * TP)
    model, tok = load_model(MODEL)
    prompts = _prompts()
    engine = LLMEngine(model, tok, num_blocks=64, block_size=BS)
    want = dict(zip(PLACEMENTS, engine_runs(engine, [prompts[r] for r in PLACEMENTS], PARAMS),
                    strict=True))
    want_h = engine_runs(engine, [prompts["h"]], H_PARAMS, prefix="h")[0]
    hq, d = MODEL.num_heads // TP, MODEL.hidden_size // MODEL.num_heads
    q, part = hq * d * 4, hq * d * 4 + hq * 4       # one row's q; its (out, LSE) partial
    # per decode step, each instance's sends: 0 asks 2 and 1 about a; 1 answers a and asks 2
    # about b; 2 answers a (to 0) and b (to 1)
    per_step = {0: 2 * q, 1: q + part, 2: 2 * part}
    # h: 0 asks 1 in 4 steps (positions 40-43), then 1 masters it and asks 0 in 5 (44-48)
    second = {0: 4 * q + 5 * part, 1: 4 * part + 5 * q, 2: 0}
    first = {me: (PARAMS.max_tokens - 1) * MODEL.num_layers * per_step[me] for me in per_step}
    h_runs = []
    for proc in range(INSTANCES * TP):
        me, tp_rank = divmod(proc, TP)
        got = json.loads((tmp_path / f"proc{proc}.json").read_text())
        assert got["data_total"] == first[me] + MODEL.num_layers * second[me], proc
        # 0's range of h held 6 blocks ([20, 44)) beside f's 18: none left for position 44
        assert got["handovers"] == ([["h", 0, 1, 44]] if me == 0 else []), proc
        assert got["free"] == BLOCKS, proc
        if tp_rank:
            continue
        assert got["data"] == first[me]
        assert got["rejected"] == [] and got["failed"] == []
        mine = {rid for rid, ranges in PLACEMENTS.items() if ranges[-1][0] == me}
        assert set(got["runs"]) == mine
        for rid in sorted(mine):
            tokens, entries = got["runs"][rid]
            lps = [msgspec.convert(e, TokenLogprob) for e in entries]
            assert_same_run(tokens, lps, want[rid], f"instance {me} {rid}")
        h_runs.append(got["runs2"].get("h", ([], [])))
        # both ranks of the instance: every block free after the release, nothing running
        assert [(s["free_blocks"], s["running"]) for s in got["last"]] == [(BLOCKS, 0)] * TP
    # h streamed from 0 (its first 5 tokens), then from 1: together the engine's run
    assert [len(t) for t, _ in h_runs] == [5, 5, 0]
    assert_same_run([t for ts, _ in h_runs for t in ts],
                    [msgspec.convert(e, TokenLogprob) for _, es in h_runs for e in es],
                    want_h, "h")
