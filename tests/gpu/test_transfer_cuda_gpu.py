"""KV transfers into CUDA caches (issue #22 items 3 and 5), skipped without CUDA: a piece is
unpacked through the Triton kernel (kernels/kv_pack_dispatch.py) and lands the torch path's
bytes; direct writes into the CUDA cache's blocks (transfer/direct.py) land the staged path's
bytes, over in-process agents and over NIXL with VRAM registrations when NIXL starts."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch
from tetris.kernels import kv_pack_dispatch as kpd
from tetris.transfer.backends import make_agent, nixl_unavailable_reason
from tetris.transfer.block_allocator import SimpleBlockAllocator
from tetris.transfer.receive_manager import ReceiveManager
from tetris.transfer.send_manager import SendManager
from tetris.transfer.states import RequestReady, TransferFailed

from tetris.config import TransferConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS, HKV, D, BS, BLOCKS, PROMPT = 3, 2, 64, 16, 24, 150
CONFIG = TransferConfig(num_backends=2, pool_size=2, backend_buffer_bytes=64 << 10,
                        send_buffer_bytes=64 << 10, bulk_chunk_bytes=16 << 10, timeout_s=30.0)
SHARDS = [(0, 0, (0, 60), [(0, 20), (40, 60)]), (1, 0, (0, 60), [(20, 40)]),
          (0, 1, (60, PROMPT), [(60, 100)]), (1, 1, (60, PROMPT), [(100, PROMPT)])]
_names = itertools.count()


def stream(config: TransferConfig, backend: str, device: str, dtype=torch.bfloat16):
    """Two members stream a request's KV into a receiver's cache on ``device`` with its
    blocks scattered; (source KV per layer, the cache after, the block table)."""
    g = torch.Generator().manual_seed(3)
    kv = [torch.randn(PROMPT, 2, HKV, D, generator=g).to(dtype).to(device) for _ in range(LAYERS)]
    tag = next(_names)
    recv = make_agent(f"gpu-recv-{tag}", backend=backend)
    order = torch.randperm(BLOCKS, generator=g).tolist()
    cache = [(torch.zeros(BLOCKS, BS, HKV, D, dtype=dtype, device=device),
              torch.zeros(BLOCKS, BS, HKV, D, dtype=dtype, device=device)) for _ in range(LAYERS)]
    receiver = ReceiveManager(0, cache, SimpleBlockAllocator(BLOCKS, order=order), recv, config)
    senders = {}
    for i in range(2):
        agent = make_agent(f"gpu-send-{tag}-{i}", backend=backend)
        agent.add_peer(recv.info())
        senders[i] = SendManager(i, agent, config)
    try:
        for s, chunk, span, ranges in SHARDS:
            senders[s].add_shard(request_id="r", chunk_index=chunk, receiver_id=0,
                                 prompt_tokens=PROMPT, chunk=span, ranges=ranges,
                                 num_layers=LAYERS, kv_heads=HKV, head_dim=D, dtype=dtype, now=0.0)
            pos = torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)
            for layer in range(LAYERS):
                senders[s].layer_ready("r", chunk, layer, kv[layer][pos])
        for _ in range(100_000):
            for mgr in senders.values():
                for env in mgr.drain_outbox():
                    receiver.deliver(env.msg, 0.0)
            for env in receiver.drain_outbox():
                senders[env.dst_id].deliver(env.msg, 0.0)
            for mgr in senders.values():
                mgr.poll(0.0)
            events = receiver.poll(0.0)
            assert not any(isinstance(e, TransferFailed) for e in events), events
            ready = [e for e in events if isinstance(e, RequestReady)]
            if ready:
                return kv, [(k.clone(), v.clone()) for k, v in cache], ready[0].block_table
        raise AssertionError("the request's KV did not arrive")
    finally:
        receiver.close()
        recv.close()
        for mgr in senders.values():
            mgr.close()
            mgr.agent.close()


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))


def _assert_holds_source(kv, cache, table) -> None:
    from tetris.kernels.kv_pack import pack_kv

    got = pack_kv(cache, torch.tensor(table, dtype=torch.int32), torch.arange(PROMPT),
                  list(range(LAYERS)))
    assert torch.equal(got, torch.stack(kv))


def test_cuda_unpack_goes_through_triton_and_lands_the_torch_path_s_bytes(monkeypatch):
    tkp = kpd._triton()
    if tkp is None:
        pytest.skip("triton is not installed")
    calls = []
    real = tkp.scatter_kv
    monkeypatch.setattr(tkp, "scatter_kv", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("TETRIS_KERNEL_BACKEND", raising=False)
    kv, triton_cache, table = stream(CONFIG, "inproc", "cuda")
    assert calls   # every piece through the Triton kernel
    monkeypatch.setenv("TETRIS_KERNEL_BACKEND", "torch")
    n = len(calls)
    _kv, torch_cache, table2 = stream(CONFIG, "inproc", "cuda")
    assert len(calls) == n and table == table2
    assert _same(triton_cache, torch_cache)
    _assert_holds_source(kv, triton_cache, table)


@pytest.mark.parametrize("backend", ["inproc", "nixl"])
def test_direct_writes_into_cuda_blocks_land_the_staged_path_s_bytes(backend):
    if backend == "nixl" and nixl_unavailable_reason() is not None:
        pytest.skip(nixl_unavailable_reason())
    kv, staged, table = stream(CONFIG, backend, "cuda")
    _kv, direct, table2 = stream(msgspec.structs.replace(CONFIG, direct_writes=True), backend,
                                 "cuda")
    assert table == table2 and _same(staged, direct)
    _assert_holds_source(kv, direct, table)
