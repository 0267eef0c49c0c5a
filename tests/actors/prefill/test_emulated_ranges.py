"""EMULATION of elastic decode's hand-off (actors/prefill/emulated_ranges.py): two emulated
prefill members of the paper's 8B deployment run a 2-chunk plan (the second chunk SP 2) and
stream each token range of the prompt to the decode receiver that holds it, in range-local
positions, over the emulated transfer backend (paper bytes timed, no payload) into meta
caches: tokens [0, 1500) to receiver 1 as ``a@0``, the rest to receiver 0 as ``a``. Each
range's transfer completes with exactly its tokens covered; no first token goes with the KV;
the senders end holding nothing; a plan whose ranges do not tile the prompt is refused."""

from __future__ import annotations

import time

import msgspec
import pytest
from range_ends import End, close, wait_ready, wire
from tetris.actors.decode.emulated import PLACEHOLDER_TOKEN, EmulatedCache, torch_dtype
from tetris.actors.prefill.emulated_ranges import EmulatedRangeExecutor
from tetris.actors.prefill.layout import forced_plan, plan_layout
from tetris.actors.prefill.messages import ChunkTask, KVRange
from tetris.transfer.backends.emulated import EmulatedAgent
from tetris.transfer.block_allocator import SimpleBlockAllocator
from tetris.transfer.receive_manager import ReceiveManager
from tetris.transfer.send_manager import SendManager
from tetris.transfer.states import FirstTokenIn, RequestReady

from tetris.config import TransferConfig, load_deployment
from tetris.scheduler.latency import load_profile

DEPLOYMENT = load_deployment("paper-llama3-8b-emulated.toml")
MODEL = DEPLOYMENT.model
TRANSFER = msgspec.structs.replace(DEPLOYMENT.transfer, timeout_s=20.0)
N, SPLIT, BS, BLOCKS = 4000, 1500, 16, 512
RANGES = (KVRange(0, SPLIT, "a@0", (1,)), KVRange(SPLIT, N, "a", (0,)))


def _agent(name: str, cfg: TransferConfig) -> EmulatedAgent:
    return EmulatedAgent(name, bandwidth=cfg.emulated_link_bandwidth,
                         bytes_per_wire_byte=cfg.emulated_bytes_per_wire_byte, transport="inproc")


@pytest.fixture
def ends():
    receivers = []
    for r in range(2):
        agent = _agent(f"emu-range-decode-{r}", TRANSFER)
        cache = EmulatedCache(MODEL.num_layers, BLOCKS, BS, MODEL.num_kv_heads,
                              torch_dtype(MODEL.dtype))
        caches = [(cache.k[i], cache.v[i]) for i in range(MODEL.num_layers)]
        mgr = ReceiveManager(r, caches, SimpleBlockAllocator(BLOCKS), agent, TRANSFER)
        receivers.append(End(f"emu-range-recv-{r}", mgr, agent))
    senders = []
    for s in range(2):
        agent = _agent(f"emu-range-prefill-{s}", TRANSFER)
        senders.append(End(f"emu-range-send-{s}", SendManager(s, agent, TRANSFER), agent))
    wire(senders, receivers)
    yield senders, receivers
    close(senders + receivers)


def _tasks(ranges):
    plan = forced_plan("a", N, "2000x1,restx2", (0, 0))
    layouts, _ = plan_layout(plan)
    return [ChunkTask(request_id="a", chunk_index=c, num_chunks=len(layouts), seq=0,
                      group=lay.group, rank=rank, chunk_start=chunk.start, chunk_end=chunk.end,
                      prompt_tokens=N, chunk_positions=lay.chunk_positions, history=lay.history,
                      moves=lay.moves, kv_ranges=ranges)
            for c, (chunk, lay) in enumerate(zip(plan.chunks, layouts, strict=True))
            for rank in range(len(lay.group))]


def test_emulated_members_stream_each_range_to_its_holder(ends):
    senders, receivers = ends
    profile = load_profile(DEPLOYMENT.scheduler.profile)
    members = {}
    for i, s in enumerate(senders):
        members[i] = EmulatedRangeExecutor(profile, MODEL, tp_size=1)
        members[i].pump = s.pump
    for rng in RANGES:
        with receivers[rng.receivers[0]].pump.locked() as mgr:
            assert mgr.reserve(rng.transfer_id, rng.end - rng.start, time.monotonic())
    tasks = _tasks(RANGES)
    assert [(t.chunk_index, t.instance) for t in tasks] == [(0, 0), (1, 0), (1, 1)]
    results = []
    for t in tasks:   # emulated members exchange nothing: one after another is the same
        members[t.instance].prepare(t)
        results.append(members[t.instance].execute(t))
    # each chunk waited Eq. 1 of the profile for its share
    assert results[0].elapsed_s >= profile.predict(1, 0, 2000)
    assert all(r.elapsed_s >= profile.predict(2, 2000, 2000) for r in results[1:])
    outcomes = wait_ready(receivers, RANGES, 20.0)
    assert sorted(outcomes) == ["a", "a@0"]
    assert all(isinstance(e, RequestReady) for e in outcomes.values())
    for rng in RANGES:   # ready means every position [0, n) of the range, range-local, came
        n = rng.end - rng.start
        ready = outcomes[rng.transfer_id]
        assert ready.prompt_tokens == n and len(ready.block_table) == -(-n // BS)
    first = [r.first_token for r in results]
    assert first.count(PLACEHOLDER_TOKEN) == 1 and not any(r.first_token_streamed for r in results)
    assert not any(isinstance(e, FirstTokenIn) for r in receivers for e in r.events)
    for s in senders:
        with s.pump.locked() as mgr:
            assert not mgr.shards
    for m in members.values():
        m.abort("a")
        assert m.holdings.requests() == []


def test_ranges_that_do_not_tile_the_prompt_are_refused(ends):
    senders, _ = ends
    member = EmulatedRangeExecutor(load_profile(DEPLOYMENT.scheduler.profile), MODEL)
    member.pump = senders[0].pump
    gap = (KVRange(0, SPLIT, "a@0", (1,)), KVRange(SPLIT + 1, N, "a", (0,)))
    with pytest.raises(ValueError, match="do not tile"):
        member.prepare(_tasks(gap)[0])
    with pytest.raises(ValueError, match="cannot be split"):
        member.prepare(_tasks((KVRange(0, N, "a", (0, 1, 2)),))[0])
