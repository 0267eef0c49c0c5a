"""attention_with_lse (torch path, CPU flash path, dispatch) against an explicit softmax."""

from __future__ import annotations

import math

import pytest
import torch

from tetris.kernels import dispatch
from tetris.kernels.attention import (
    attention_with_lse,
    attention_with_lse_cpu_flash,
    attention_with_lse_ref,
)
from tetris.kernels.merge import merge_attention_all


def _qkv(tq, tk, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=g).to(dtype)
    k = torch.randn(tk, hkv, d, generator=g).to(dtype)
    v = torch.randn(tk, hkv, d, generator=g).to(dtype)
    return q, k, v


def _explicit(q, k, v, visible):
    """Per head, per query: softmax over the visible keys, written out with Python loops."""
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(tq, hq, d)
    lse = torch.full((hq, tq), float("-inf"))
    for h in range(hq):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(tq):
            keys = [j for j in range(k.shape[0]) if visible(i, j)]
            if not keys:
                continue
            s = (kh[keys] @ q[i, h].double()) / math.sqrt(d)
            lse[h, i] = torch.logsumexp(s, 0).float()
            out[i, h] = (torch.softmax(s, 0) @ vh[keys]).float()
    return out, lse


def _assert_matches(got, want, atol=1e-5):
    out, lse = got
    ref_out, ref_lse = want
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=atol, rtol=atol)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=atol)


IMPLS = [attention_with_lse_ref, attention_with_lse, attention_with_lse_cpu_flash,
         dispatch.attention_with_lse]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_non_causal_and_causal_match_explicit_softmax(impl, hq, hkv):
    q, k, v = _qkv(9, 9, hq, hkv)
    _assert_matches(impl(q, k, v), _explicit(q, k, v, lambda i, j: True))
    _assert_matches(impl(q, k, v, causal=True), _explicit(q, k, v, lambda i, j: j <= i))


@pytest.mark.parametrize("impl", IMPLS)
def test_position_mask_zigzag_like(impl):
    # Queries hold pieces 0 and 3 of a 4-piece chunk; keys hold pieces 1 and 2 (a ring step):
    # the first piece's queries see no key at all, so their rows are empty.
    qp = torch.tensor([0, 1, 2, 9, 10, 11])
    kp = torch.tensor([3, 4, 5, 6, 7, 8])
    q, k, v = _qkv(6, 6, 4, 2)
    got = impl(q, k, v, causal=True, q_positions=qp, k_positions=kp)
    want = _explicit(q, k, v, lambda i, j: kp[j] <= qp[i])
    _assert_matches(got, want)
    assert torch.isneginf(got[1][:, :3]).all() and torch.isfinite(got[1][:, 3:]).all()
    assert torch.equal(got[0][:3], torch.zeros(3, 4, 16))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_key_or_query_sets(impl):
    q, k, v = _qkv(3, 0)
    out, lse = impl(q, k, v)
    assert torch.equal(out, torch.zeros(3, 4, 16)) and torch.isneginf(lse).all()
    out, lse = impl(q[:0], *_qkv(0, 5)[1:])
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


def test_custom_scale_is_used():
    q, k, v = _qkv(5, 7)
    got = attention_with_lse(q, k, v, scale=0.5)
    want = attention_with_lse_ref(q * (0.5 * math.sqrt(16)), k, v)
    _assert_matches(got, want)


def test_query_blocks_cover_long_sequences(monkeypatch):
    import tetris.kernels.attention as attention

    monkeypatch.setattr(attention, "_QUERY_BLOCK", 4)  # several ragged blocks
    q, k, v = _qkv(11, 11, 8, 2)
    _assert_matches(attention.attention_with_lse(q, k, v, causal=True),
                    attention_with_lse_ref(q, k, v, causal=True), atol=1e-6)


@pytest.mark.parametrize("splits", [[5], [3, 9], [1, 2, 7, 12]])
def test_key_shards_merged_by_lse_equal_full_attention(splits):
    # What ring attention relies on: any split of the keys, each part attended with its
    # absolute positions, merged by LSE, is exactly causal attention over all keys.
    t = 14
    q, k, v = _qkv(t, t, 4, 2, seed=3)
    pos = torch.arange(t)
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(1))  # shards need not be sorted
    bounds = [0, *splits, t]
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        idx = perm[a:b]
        parts.append(attention_with_lse(q, k[idx], v[idx], q_positions=pos, k_positions=pos[idx]))
    _assert_matches(merge_attention_all(parts), attention_with_lse_ref(q, k, v, causal=True))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_path_equals_reference(dtype, atol, causal):
    q, k, v = _qkv(33, 33, 8, 2, d=32, dtype=dtype)
    got = attention_with_lse_cpu_flash(q, k, v, causal=causal)
    assert got[0].dtype == dtype
    _assert_matches(got, attention_with_lse_ref(q, k, v, causal=causal), atol=atol)


def test_cpu_flash_position_mask_in_query_blocks(monkeypatch):
    import tetris.kernels.attention as attention

    monkeypatch.setattr(attention, "_QUERY_BLOCK", 3)
    q, k, v = _qkv(10, 7, 8, 2, seed=9)
    qp = torch.tensor([0, 1, 2, 3, 4, 15, 16, 17, 18, 19])
    kp = torch.tensor([3, 5, 7, 9, 11, 13, 14])  # queries 0-2 see no key
    got = attention.attention_with_lse_cpu_flash(q, k, v, q_positions=qp, k_positions=kp)
    _assert_matches(got, _explicit(q, k, v, lambda i, j: kp[j] <= qp[i]))
    assert torch.isneginf(got[1][:, :3]).all()


def test_dispatch_prefers_cpu_flash_on_cpu(monkeypatch):
    monkeypatch.delenv("TETRIS_KERNEL_BACKEND", raising=False)
    q, k, _ = _qkv(4, 4)
    pos = torch.arange(4)
    assert dispatch.attention_backend_for(q, k, causal=True) == "cpu_flash"
    assert dispatch.attention_backend_for(q, k, q_positions=pos, k_positions=pos) == "cpu_flash"
    assert dispatch.attention_backend_for(q.double(), k.double()) == "torch"
    monkeypatch.setenv("TETRIS_KERNEL_BACKEND", "torch")
    assert dispatch.attention_backend_for(q, k, causal=True) == "torch"
    assert "torch" in dispatch.available_backends()


def test_bf16_torch_path_close_to_fp32_reference():
    q, k, v = _qkv(17, 17, 4, 2, dtype=torch.bfloat16)
    out, lse = attention_with_lse(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    _assert_matches((out, lse), attention_with_lse_ref(q, k, v, causal=True), atol=2e-2)


@pytest.mark.parametrize("kwargs,shapes,match", [
    ({}, ((3, 4, 8), (3, 3, 8), (3, 3, 8)), "multiple of KV heads"),
    ({}, ((3, 4, 8), (3, 2, 4), (3, 2, 4)), "head_dim"),
    ({"causal": True}, ((3, 4, 8), (5, 2, 8), (5, 2, 8)), "Tq == Tk"),
    ({"q_positions": torch.arange(3)}, ((3, 4, 8), (3, 2, 8), (3, 2, 8)), "together"),
    ({}, ((3, 4, 8), (3, 2, 8), (4, 2, 8)), "same shape"),
])
def test_bad_inputs_raise_clear_errors(kwargs, shapes, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    for impl in IMPLS:
        with pytest.raises(ValueError, match=match):
            impl(q, k, v, **kwargs)
