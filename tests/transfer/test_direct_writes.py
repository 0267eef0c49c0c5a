"""Direct writes (transfer/direct.py): pieces go straight into the receiver's KV blocks, no
receive staging. Against the staged path on the same shards: the decode cache holds the same
bytes, over the in-process backend and over real NIXL agents (UCX, host memory here); an
abort holds the request's blocks until its granted writes landed or the grace passed."""

from __future__ import annotations

import itertools
import time

import msgspec
import numpy as np
import pytest
import torch
from tetris.kernels.kv_pack import pack_kv
from tetris.transfer.backends import make_agent, nixl_unavailable_reason
from tetris.transfer.block_allocator import SimpleBlockAllocator
from tetris.transfer.direct import piece_descriptors
from tetris.transfer.messages import DirectTarget, RegionDesc
from tetris.transfer.receive_manager import ReceiveManager
from tetris.transfer.send_manager import SendManager
from tetris.transfer.states import RequestReady, TransferFailed
from transfer_helpers import BS, HKV, LAYERS, D, paged_cache, source_kv

from tetris.config import TransferConfig

STAGED = TransferConfig(num_backends=2, pool_size=3, backend_buffer_bytes=1024,
                        send_buffer_bytes=1024, bulk_chunk_bytes=512, timeout_s=20.0,
                        abort_grace_s=0.5)
DIRECT = msgspec.structs.replace(STAGED, direct_writes=True)
BLOCKS = 32
_names = itertools.count()


class Wire:
    """Senders and one receive manager on agents of one backend, blocks scattered in the
    cache (a permuted free list), so that pieces cross blocks that are not adjacent."""

    def __init__(self, config: TransferConfig, backend: str, senders: int = 2) -> None:
        tag = next(_names)
        self.recv_agent = make_agent(f"direct-recv-{tag}", backend=backend)
        order = np.random.default_rng(1).permutation(BLOCKS).tolist()
        self.allocator = SimpleBlockAllocator(BLOCKS, order=order)
        self.cache = paged_cache(LAYERS, BLOCKS, fill=False)
        self.receiver = ReceiveManager(0, self.cache, self.allocator, self.recv_agent, config)
        self.senders = {}
        for i in range(senders):
            agent = make_agent(f"direct-send-{tag}-{i}", backend=backend)
            agent.add_peer(self.recv_agent.info())
            self.senders[i] = SendManager(i, agent, config)
        self.now = 0.0

    def route(self) -> None:
        for mgr in self.senders.values():
            for env in mgr.drain_outbox():
                self.receiver.deliver(env.msg, self.now)
        for env in self.receiver.drain_outbox():
            self.senders[env.dst_id].deliver(env.msg, self.now)

    def run_until_ready(self, limit_s: float = 20.0) -> RequestReady:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            self.route()
            for i in sorted(self.senders):
                self.senders[i].poll(self.now)
            self.route()
            for e in self.receiver.poll(self.now):
                assert not isinstance(e, TransferFailed), e
                if isinstance(e, RequestReady):
                    return e
        raise AssertionError("the request's KV did not arrive")

    def close(self) -> None:
        self.receiver.close()
        self.recv_agent.close()
        for mgr in self.senders.values():
            mgr.close()
            mgr.agent.close()


# (sender, chunk, chunk span, ranges): zigzag-like pieces of two chunks over two members
SHARDS = [(0, 0, (0, 20), [(0, 5), (15, 20)]), (1, 0, (0, 20), [(5, 15)]),
          (0, 1, (20, 45), [(20, 26), (39, 45)]), (1, 1, (20, 45), [(26, 39)])]
PROMPT = 45


def _stream(config: TransferConfig, backend: str):
    """The request's KV streamed by both members; (source KV, the receiver's cache, its blocks,
    the receive backends' buffers)."""
    w = Wire(config, backend)
    try:
        kv = source_kv(PROMPT, seed=7)
        for s, chunk, span, ranges in SHARDS:
            w.senders[s].add_shard(request_id="r", chunk_index=chunk, receiver_id=0,
                                   prompt_tokens=PROMPT, chunk=span, ranges=ranges,
                                   num_layers=LAYERS, kv_heads=HKV, head_dim=D,
                                   dtype=torch.float32, now=w.now)
            pos = torch.cat([torch.arange(a, b) for a, b in ranges])
            for layer in range(LAYERS):
                w.senders[s].layer_ready("r", chunk, layer, kv[layer][pos])
        ready = w.run_until_ready()
        cache = [(k.clone(), v.clone()) for k, v in w.cache]
        buffers = [b.buffer.clone() for b in w.receiver.backends]
        return kv, cache, ready.block_table, buffers
    finally:
        w.close()


def _backends():
    out = ["inproc"]
    if nixl_unavailable_reason() is None:
        out.append("nixl")
    return out


@pytest.mark.parametrize("backend", _backends())
def test_direct_writes_land_the_staged_path_s_bytes_with_no_receive_staging(backend):
    kv, staged, table, _ = _stream(STAGED, backend)
    kv2, direct, table2, buffers = _stream(DIRECT, backend)
    assert table == table2 and table != sorted(table)     # the same blocks, not adjacent
    for (k, v), (k2, v2) in zip(staged, direct):
        assert torch.equal(k, k2) and torch.equal(v, v2)   # the whole cache, bit for bit
    got = pack_kv(direct, torch.tensor(table, dtype=torch.int32), torch.arange(PROMPT),
                  list(range(LAYERS)))
    assert torch.equal(got, torch.stack(kv2)) and torch.equal(torch.stack(kv), torch.stack(kv2))
    assert all(int(b.count_nonzero()) == 0 for b in buffers)   # nothing went through staging


def test_piece_descriptors_one_per_run_of_cache_slots():
    row = HKV * D * 4
    k = tuple(RegionDesc(agent="d", addr=1000 * (i + 1), nbytes=BLOCKS * BS * row) for i in range(2))
    v = tuple(RegionDesc(agent="d", addr=5000 * (i + 1), nbytes=BLOCKS * BS * row) for i in range(2))
    target = DirectTarget(k_regions=k, v_regions=v, row_bytes=row, block_size=BS, blocks=(5, 2, 3))
    # positions 2..6 and 9: slots 22, 23 (block 5), 8, 9, 10 (block 2), 13 (block 3)
    descs = piece_descriptors(target, 1, np.array([2, 3, 4, 5, 6, 9]))
    n = 6
    assert descs == [(0, k[1], 22 * row, 2 * row), (2 * row, k[1], 8 * row, 3 * row),
                     (5 * row, k[1], 13 * row, row),
                     (n * row, v[1], 22 * row, 2 * row), ((n + 2) * row, v[1], 8 * row, 3 * row),
                     ((n + 5) * row, v[1], 13 * row, row)]
    with pytest.raises(ValueError, match="blocks granted"):
        piece_descriptors(target, 0, np.array([12]))


def _granted_write_in_flight(config: TransferConfig) -> tuple[Wire, list[int]]:
    """One shard granted its one credit (one slot: one piece in flight at a time) and that
    piece posted, not yet performed (in-process backend)."""
    w = Wire(msgspec.structs.replace(config, backend_slots=1), "inproc", senders=1)
    kv = source_kv(8, seed=3)
    w.senders[0].add_shard(request_id="r", chunk_index=0, receiver_id=0, prompt_tokens=8,
                           chunk=(0, 8), ranges=[(0, 8)], num_layers=LAYERS, kv_heads=HKV,
                           head_dim=D, dtype=torch.float32, now=w.now)
    for layer in range(LAYERS):
        w.senders[0].layer_ready("r", 0, layer, kv[layer])
    w.route()
    w.receiver.poll(w.now)          # grants
    w.route()
    w.senders[0].poll(w.now)        # the write is posted; its bytes move at the next poll
    assert w.senders[0].needs_polling()   # a write is on the wire
    return w, list(w.receiver.requests["r"].blocks)


def test_an_abort_holds_the_blocks_until_the_granted_write_landed():
    w, blocks = _granted_write_in_flight(DIRECT)
    try:
        w.receiver.abort("r", "client gone", w.now)
        assert w.receiver.held_back() == sorted(blocks)
        assert w.allocator.num_free == BLOCKS - len(blocks)   # not reusable yet
        w.senders[0].poll(w.now)      # the straggler lands in the held blocks, notice after it
        assert any(int(k.view(-1, BS, HKV, D)[b].count_nonzero()) for k, _ in w.cache
                   for b in blocks)
        w.receiver.poll(w.now)        # its notice: that writer is done
        assert w.receiver.held_back() == [] and w.allocator.num_free == BLOCKS
        assert w.receiver.idle()
    finally:
        w.close()


def test_an_abort_frees_held_blocks_after_the_grace_when_no_write_lands():
    w, blocks = _granted_write_in_flight(DIRECT)
    try:
        w.receiver.abort("r", "client gone", w.now)   # and the sender is never heard of again
        w.receiver.poll(w.now + DIRECT.abort_grace_s * 0.9)
        assert w.receiver.held_back() == sorted(blocks) and not w.receiver.idle()
        w.receiver.poll(w.now + DIRECT.abort_grace_s)
        assert w.receiver.held_back() == [] and w.allocator.num_free == BLOCKS
    finally:
        w.close()


def test_staged_pieces_free_an_aborted_request_s_blocks_at_once():
    w, _ = _granted_write_in_flight(STAGED)
    try:
        w.receiver.abort("r", "client gone", w.now)   # a straggler lands in a fenced slot only
        assert w.receiver.held_back() == [] and w.allocator.num_free == BLOCKS
    finally:
        w.close()


def test_direct_writes_need_a_backend_with_scattered_writes():
    from tetris.transfer.backends.emulated import EmulatedAgent

    agent = EmulatedAgent(f"direct-emu-{next(_names)}", bandwidth=1e9, bytes_per_wire_byte=1.0,
                          transport="local")
    try:
        assert not agent.capabilities.scattered_writes
        with pytest.raises(ValueError, match="direct_writes needs a backend with scattered writes"):
            ReceiveManager(0, paged_cache(LAYERS, 4, fill=False), SimpleBlockAllocator(4), agent,
                           DIRECT)
    finally:
        agent.close()
