"""KV pack/unpack of transfers through one dispatch (kernels/kv_pack_dispatch.py): Triton for
CUDA caches, torch otherwise. No GPU here: the choice is tested on its inputs, and the receive
manager's unpack runs through the Triton kernel in the interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets) when TETRIS_KERNEL_BACKEND=triton asks for it, landing the same bytes
as the torch path."""

from __future__ import annotations

import pytest
import torch
from tetris.kernels import kv_pack_dispatch as kpd
from tetris.kernels.kv_pack import pack_kv as torch_pack_kv
from tetris.transfer.states import RequestReady
from transfer_helpers import HKV, LAYERS, Cluster, D, source_kv

from tetris.config import TransferConfig

CONFIG = TransferConfig(num_backends=2, pool_size=3, backend_buffer_bytes=1024,
                        send_buffer_bytes=1024, bulk_chunk_bytes=512, timeout_s=5.0)
F32, BF16, I8 = torch.float32, torch.bfloat16, torch.int8


@pytest.mark.parametrize("device, dtype, contiguous, asked, interpret, importable, want", [
    ("cuda", BF16, True, None, False, True, "triton"),      # serving on a GPU
    ("cuda", F32, True, "triton", False, True, "triton"),
    ("cuda", BF16, True, "torch", False, True, "torch"),    # forced
    ("cuda", BF16, True, "flash_attn", False, True, "torch"),   # flash-attn packs no KV
    ("cuda", BF16, False, None, False, True, "torch"),      # the kernel needs contiguous caches
    ("cuda", I8, True, None, False, True, "torch"),
    ("cuda", BF16, True, None, False, False, "torch"),      # triton not installed
    ("cpu", F32, True, None, True, True, "torch"),          # the interpreter only when asked
    ("cpu", F32, True, "triton", True, True, "triton"),
    ("cpu", F32, True, "triton", False, True, "torch"),
])
def test_choice_on_its_inputs(device, dtype, contiguous, asked, interpret, importable, want):
    assert kpd.kv_pack_backend(device, dtype, contiguous, asked=asked, interpret=interpret,
                               triton_importable=importable) == want


def test_choice_for_cache_tensors(monkeypatch):
    monkeypatch.delenv("TETRIS_KERNEL_BACKEND", raising=False)
    cpu = torch.zeros(4, 4, HKV, D)
    meta = torch.empty(4, 4, HKV, D, device="meta")
    assert kpd.kv_pack_backend_for(cpu, cpu) == "torch"
    assert kpd.kv_pack_backend_for(meta, meta) == "torch"   # emulated caches write nothing
    monkeypatch.setenv("TETRIS_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kpd.kv_pack_backend_for(meta, meta) == "torch"
    want = "triton" if kpd._triton() is not None else "torch"
    assert kpd.kv_pack_backend_for(cpu, cpu) == want
    assert kpd.kv_pack_backend_for(cpu[:, :2], cpu[:, :2]) == "torch"   # not contiguous


def _transfer(num_tokens: int, seed: int):
    """One sender streams a request's KV to a receive manager; its cache and block table."""
    c = Cluster(1, CONFIG)
    kv = source_kv(num_tokens, seed=seed)
    c.senders[0].add_shard(request_id="r", chunk_index=0, receiver_id=0, prompt_tokens=num_tokens,
                           chunk=(0, num_tokens), ranges=[(0, num_tokens)], num_layers=LAYERS,
                           kv_heads=HKV, head_dim=D, dtype=torch.float32, now=c.now)
    for layer in range(LAYERS):
        c.senders[0].layer_ready("r", 0, layer, kv[layer])
    for _ in range(500):
        ready = [e for e in c.step() if isinstance(e, RequestReady)]
        if ready:
            break
    else:
        raise AssertionError("the transfer did not finish")
    cache = [(k.clone(), v.clone()) for k, v in c.recv_cache]
    c.close()
    return kv, cache, torch.tensor(ready[0].block_table, dtype=torch.int32)


def test_receive_manager_unpacks_through_the_chosen_kernel(monkeypatch):
    tkp = kpd._triton()
    if tkp is None:
        pytest.skip("triton is not installed")
    from tetris.kernels import triton_attention

    if not triton_attention.INTERPRETED and not torch.cuda.is_available():
        pytest.skip("triton kernels need CUDA or TRITON_INTERPRET=1 at import")
    calls = []
    real = tkp.scatter_kv
    monkeypatch.setattr(tkp, "scatter_kv", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("TETRIS_KERNEL_BACKEND", raising=False)
    kv, torch_cache, table = _transfer(23, seed=4)
    assert calls == []                        # CPU caches: the torch path
    got = torch_pack_kv(torch_cache, table, torch.arange(23), list(range(LAYERS)))
    assert torch.equal(got, torch.stack(kv))
    monkeypatch.setenv("TETRIS_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kv2, triton_cache, table2 = _transfer(23, seed=4)
    assert len(calls) > 0                     # every piece through the Triton kernel
    assert torch.equal(table, table2)
    assert all(torch.equal(a, b) for x, y in zip(torch_cache, triton_cache) for a, b in zip(x, y))
    got = torch_pack_kv(triton_cache, table, torch.arange(23), list(range(LAYERS)))
    assert torch.equal(got, torch.stack(kv2))
