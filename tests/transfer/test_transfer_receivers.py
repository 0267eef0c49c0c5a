"""One sender streams each chunk to two receivers (the TP ranks of a decode instance), each
taking its own slice of the KV heads: shards are keyed by (request, chunk, receiver)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tetris.config import TransferConfig
from tetris.kernels.kv_pack import pack_kv
from tetris.transfer.backends import InProcAgent
from tetris.transfer.block_allocator import SimpleBlockAllocator
from tetris.transfer.messages import TransferError
from tetris.transfer.receive_manager import ReceiveManager
from tetris.transfer.send_manager import SendManager
from tetris.transfer.states import RequestReady, ShardSent, TransferFailed, TransferState

LAYERS, HKV, D, BS, BLOCKS = 2, 4, 8, 4, 16
CFG = TransferConfig(num_backends=2, pool_size=2, backend_buffer_bytes=512, send_buffer_bytes=512,
                     bulk_chunk_bytes=512, timeout_s=1.0, abort_grace_s=0.05)
_names = itertools.count()


class TwoRanks:
    """Senders 0 and 1 and receivers 10, 11 (heads [0, 2) and [2, 4)), routed in process."""

    def __init__(self) -> None:
        tag = next(_names)
        self.now = 0.0
        self.receivers: dict[int, ReceiveManager] = {}
        self.allocators: dict[int, SimpleBlockAllocator] = {}
        infos = []
        for rid in (10, 11):
            agent = InProcAgent(f"mr{tag}-recv{rid}")
            cache = [(torch.zeros(BLOCKS, BS, HKV // 2, D), torch.zeros(BLOCKS, BS, HKV // 2, D))
                     for _ in range(LAYERS)]
            self.allocators[rid] = SimpleBlockAllocator(BLOCKS)
            self.receivers[rid] = ReceiveManager(rid, cache, self.allocators[rid], agent, CFG)
            infos.append(agent.info())
        self.senders: dict[int, SendManager] = {}
        for sid in (0, 1):
            agent = InProcAgent(f"mr{tag}-send{sid}")
            for info in infos:
                agent.add_peer(info)
            self.senders[sid] = SendManager(sid, agent, CFG)
        self.sender_events: list = []
        self.receiver_events: list = []

    def route(self) -> None:
        for s in self.senders.values():
            for env in s.drain_outbox():
                self.receivers[env.dst_id].deliver(env.msg, self.now)
        for r in self.receivers.values():
            for env in r.drain_outbox():
                self.senders[env.dst_id].deliver(env.msg, self.now)

    def step(self) -> None:
        self.now += 0.01
        self.route()
        for sid in sorted(self.senders):
            self.sender_events += [(sid, e) for e in self.senders[sid].poll(self.now)]
        self.route()
        for rid in sorted(self.receivers):
            self.receiver_events += [(rid, e) for e in self.receivers[rid].poll(self.now)]
        self.route()

    def add(self, sid, chunk, span, ranges, prompt):
        for rid in (10, 11):
            self.senders[sid].add_shard(request_id="q", chunk_index=chunk, receiver_id=rid,
                                        prompt_tokens=prompt, chunk=span, ranges=ranges,
                                        num_layers=LAYERS, kv_heads=HKV // 2, head_dim=D,
                                        dtype=torch.float32, now=self.now)

    def give_layers(self, sid, chunk, ranges, kv):
        pos = torch.cat([torch.arange(a, b) for a, b in ranges])
        for layer in range(LAYERS):
            for j, rid in enumerate((10, 11)):
                heads = slice(j * HKV // 2, (j + 1) * HKV // 2)
                self.senders[sid].layer_ready("q", chunk, layer, kv[layer, pos][:, :, heads].clone(),
                                              receiver_id=rid)


def _truth(n: int) -> torch.Tensor:
    return torch.randn((LAYERS, n, 2, HKV, D), generator=torch.Generator().manual_seed(n))


def test_each_receiver_gets_its_head_slice_bitwise():
    c = TwoRanks()
    n = 30
    kv = _truth(n)
    shards = [(0, 0, (0, 12), [(0, 3), (9, 12)]), (1, 0, (0, 12), [(3, 9)]),
              (0, 1, (12, 30), [(12, 16), (26, 30)]), (1, 1, (12, 30), [(16, 26)])]
    for sid, chunk, span, ranges in shards:
        c.add(sid, chunk, span, ranges, n)
        c.give_layers(sid, chunk, ranges, kv)
    for _ in range(400):
        c.step()
        if sum(isinstance(e, RequestReady) for _, e in c.receiver_events) == 2:
            break
    ready = {rid: e for rid, e in c.receiver_events if isinstance(e, RequestReady)}
    assert sorted(ready) == [10, 11]
    for j, rid in enumerate((10, 11)):
        table = torch.tensor(ready[rid].block_table, dtype=torch.int32)
        got = pack_kv(c.receivers[rid].kv_caches, table, torch.arange(n), list(range(LAYERS)))
        assert torch.equal(got, kv[:, :, :, j * 2:(j + 1) * 2])
    # one ShardSent per (sender, chunk, receiver): 4 shards x 2 receivers
    assert len([e for _, e in c.sender_events if isinstance(e, ShardSent)]) == 8
    for sid, s in c.senders.items():
        assert all(s.state("q", k, r) == TransferState.DONE for k in (0, 1) for r in (10, 11))
        s.forget("q")
        assert s.held("q") == []


def test_receiver_id_is_required_when_a_chunk_has_two_receivers():
    c = TwoRanks()
    c.add(0, 0, (0, 4), [(0, 4)], 4)
    kv = torch.zeros(4, 2, HKV // 2, D)
    with pytest.raises(ValueError, match="name one"):
        c.senders[0].layer_ready("q", 0, 0, kv)
    with pytest.raises(ValueError, match="name one"):
        c.senders[0].state("q", 0)
    with pytest.raises(ValueError, match="already added"):
        c.add(0, 0, (0, 4), [(0, 4)], 4)
    with pytest.raises(KeyError):
        c.senders[0].layer_ready("q", 0, 0, kv, receiver_id=12)


def test_rejection_by_one_receiver_fails_only_its_shard():
    c = TwoRanks()
    c.add(0, 0, (0, 4), [(0, 4)], 4)
    s = c.senders[0]
    s.drain_outbox()
    s.deliver(TransferError(request_id="q", sender_id=0, chunk_index=0, reason="bad", receiver_id=11), c.now)
    assert s.state("q", 0, 11) == TransferState.FAILED
    assert s.state("q", 0, 10) == TransferState.BOOTSTRAPPING
    # a receiver that does not name itself (-1) rejects the chunk for all of its receivers
    s.deliver(TransferError(request_id="q", sender_id=0, chunk_index=0, reason="bad"), c.now)
    assert s.state("q", 0, 10) == TransferState.FAILED


def test_abort_from_one_rank_reaches_the_other_and_frees_both():
    c = TwoRanks()
    kv = _truth(8)
    c.add(0, 0, (0, 8), [(0, 8)], 8)
    c.give_layers(0, 0, [(0, 8)], kv)
    c.step()
    assert all(a.num_free < BLOCKS for a in c.allocators.values())
    c.receivers[10].abort("q", "client gone", c.now)
    for _ in range(3):
        c.step()
    failed = {rid: e.reason for rid, e in c.receiver_events if isinstance(e, TransferFailed)}
    assert sorted(failed) == [10, 11]
    assert failed[10] == "client gone"
    assert failed[11].startswith("aborted by sender 0")   # told by the sender, not by rank 10
    assert all(a.num_free == BLOCKS for a in c.allocators.values())
    assert all(c.senders[0].state("q", 0, r) == TransferState.FAILED for r in (10, 11))


def test_lost_receiver_fails_only_its_shards():
    c = TwoRanks()
    c.add(1, 0, (0, 4), [(0, 4)], 4)
    c.senders[1].peer_lost(11)
    assert c.senders[1].state("q", 0, 11) == TransferState.FAILED
    assert c.senders[1].state("q", 0, 10) == TransferState.BOOTSTRAPPING
