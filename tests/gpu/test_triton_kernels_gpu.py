"""Triton (and flash-attn, when installed) kernels on a GPU at larger shapes in bf16.

Skipped without CUDA (tests/conftest.py). Run with the compiled kernels, not the interpreter:
    TRITON_INTERPRET=0 python -m pytest -q tests/gpu
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
ta = pytest.importorskip("tetris.kernels.triton_attention")
from tetris.kernels import flash_attn_backend as fab  # noqa: E402
from tetris.kernels import kv_pack  # noqa: E402
from tetris.kernels import triton_kv_pack as tkp  # noqa: E402
from tetris.kernels import triton_merge as tm  # noqa: E402
from tetris.kernels import triton_paged_decode as tpd  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(ta.INTERPRETED, reason="set TRITON_INTERPRET=0 to test the compiled kernels"),
]
BF16 = dict(atol=2e-2, rtol=2e-2)


def _qkv(tq, tk, hq=32, hkv=8, d=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(tq, hq, d, generator=g, device="cuda", dtype=dtype),
            torch.randn(tk, hkv, d, generator=g, device="cuda", dtype=dtype),
            torch.randn(tk, hkv, d, generator=g, device="cuda", dtype=dtype))


def _zigzag(offset, chunk, members, r):
    piece = chunk // (2 * members)
    j = 2 * members - 1 - r
    idx = list(range(r * piece, (r + 1) * piece)) + list(range(j * piece, (j + 1) * piece))
    return torch.tensor(idx, device="cuda") + offset


def _close(got, want):
    (out, lse), (ref_out, ref_lse) = got, want
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out.float(), ref_out.float(), **BF16)


@pytest.mark.parametrize("mask", ["none", "causal", "zigzag"])
def test_attention_step_bf16(mask):
    if mask == "zigzag":
        q_pos, k_pos = _zigzag(1024, 2048, 2, 0), _zigzag(1024, 2048, 2, 1)
        q, k, v = _qkv(len(q_pos), len(k_pos))
        kw = {"q_positions": q_pos, "k_positions": k_pos}
    else:
        q, k, v = _qkv(1024, 1024 if mask == "causal" else 1500)
        kw = {"causal": mask == "causal"}
    _close(ta.attention_with_lse(q, k, v, **kw), ta.attention_with_lse_reference(q, k, v, **kw))


def test_zigzag_ring_merge_bf16_equals_causal():
    history, chunk, members = 512, 1024, 2
    q_all, k_all, v_all = _qkv(history + chunk, history + chunk, seed=1)
    want = ta.attention_with_lse_reference(q_all, k_all, v_all, causal=True)
    shards = [_zigzag(history, chunk, members, r) for r in range(members)]
    hist = torch.arange(history, device="cuda")
    for q_idx in shards:
        out, lse = ta.attention_with_lse(q_all[q_idx], k_all[hist], v_all[hist])
        for k_idx in shards:
            o, l = ta.attention_with_lse(q_all[q_idx], k_all[k_idx], v_all[k_idx], q_positions=q_idx,
                                         k_positions=k_idx)
            out, lse = tm.merge_attention(out, lse, o, l)
        _close((out, lse), (want[0][q_idx], want[1][:, q_idx]))


def test_paged_decode_bf16_long_context():
    b, page, maxb = 6, 16, 256  # up to 4096 tokens per sequence
    g = torch.Generator(device="cuda").manual_seed(2)
    nb = b * maxb
    k_cache = torch.randn(nb, page, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(nb, page, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(nb, generator=g, device="cuda").view(b, maxb).to(torch.int32)
    lens = torch.tensor([1, 17, 512, 1000, 4095, 4096], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    got = tpd.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    want = tpd.paged_decode_attention_reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(got.float(), want.float(), **BF16)


def test_kv_pack_round_trip_bf16():
    g = torch.Generator(device="cuda").manual_seed(3)
    caches = [(torch.randn(64, 16, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16),
               torch.randn(64, 16, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
    table = torch.randperm(64, generator=g, device="cuda").to(torch.int32)
    positions = torch.arange(100, 900, device="cuda")
    packed = tkp.pack_kv(caches, table, positions, [3, 1, 0])
    assert torch.equal(packed, kv_pack.pack_kv(caches, table, positions, [3, 1, 0]))
    other = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    tkp.unpack_kv(other, table, positions, [3, 1, 0], packed)
    assert torch.equal(tkp.pack_kv(other, table, positions, [3, 1, 0]), packed)


@pytest.mark.skipif(not fab.AVAILABLE, reason="flash-attn not installed")
@pytest.mark.parametrize("mask", ["none", "causal", "zigzag"])
def test_flash_attn_step_bf16(mask):
    if mask == "zigzag":
        q_pos, k_pos = _zigzag(256, 2048, 2, 1), _zigzag(256, 2048, 2, 0)
        q, k, v = _qkv(len(q_pos), len(k_pos), seed=4)
        kw = {"q_positions": q_pos, "k_positions": k_pos}
    else:
        q, k, v = _qkv(1024, 1024, seed=4)
        kw = {"causal": mask == "causal"}
    _close(fab.attention_with_lse(q, k, v, **kw), ta.attention_with_lse_reference(q, k, v, **kw))


@pytest.mark.skipif(not fab.AVAILABLE, reason="flash-attn not installed")
def test_flash_attn_paged_decode_bf16():
    b, page, maxb = 4, 256, 8
    g = torch.Generator(device="cuda").manual_seed(5)
    k_cache = torch.randn(b * maxb, page, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(b * maxb, page, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(b * maxb, generator=g, device="cuda").view(b, maxb).to(torch.int32)
    lens = torch.tensor([0, 300, 1024, 2048], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    got = fab.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    want = tpd.paged_decode_attention_reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(got.float(), want.float(), **BF16)
