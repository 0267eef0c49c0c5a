"""merge_attention: the log-sum-exp combination of partial attention results."""

from __future__ import annotations

import pytest
import torch

from tetris.kernels.attention import attention_with_lse_ref
from tetris.kernels.merge import merge_attention, merge_attention_all


def _qkv(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 4, 8, generator=g), torch.randn(t, 2, 8, generator=g),
            torch.randn(t, 2, 8, generator=g))


def test_merge_of_two_halves_equals_full_and_is_symmetric():
    q, k, v = _qkv(10)
    a = attention_with_lse_ref(q, k[:4], v[:4])
    b = attention_with_lse_ref(q, k[4:], v[4:])
    full_out, full_lse = attention_with_lse_ref(q, k, v)
    for out, lse in (merge_attention(*a, *b), merge_attention(*b, *a)):
        torch.testing.assert_close(out, full_out, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-5)


def test_neg_inf_sides_are_ignored_and_both_empty_stays_empty():
    q, k, v = _qkv(4)
    out, lse = attention_with_lse_ref(q, k, v)
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    m_out, m_lse = merge_attention(empty_out, empty_lse, out, lse)
    assert torch.equal(m_out, out) and torch.equal(m_lse, lse)
    e_out, e_lse = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert not torch.isnan(e_out).any() and torch.equal(e_out, empty_out)
    assert torch.isneginf(e_lse).all()


def test_mixed_rows_one_side_empty_per_row():
    q, k, v = _qkv(6, seed=2)
    pos = torch.arange(6)
    # Keys 3..5 are in the future of queries 0..2: those rows are empty on the second side.
    a = attention_with_lse_ref(q, k[:3], v[:3], q_positions=pos, k_positions=pos[:3])
    b = attention_with_lse_ref(q, k[3:], v[3:], q_positions=pos, k_positions=pos[3:])
    assert torch.isneginf(b[1][:, :3]).all()
    out, lse = merge_attention(*a, *b)
    ref_out, ref_lse = attention_with_lse_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-5)


def test_merge_keeps_out_dtype_and_merge_all_order_free():
    q, k, v = _qkv(8, seed=4)
    parts = [attention_with_lse_ref(q.bfloat16(), k[i::3].bfloat16(), v[i::3].bfloat16())
             for i in range(3)]
    out, lse = merge_attention_all(parts)
    out_rev, lse_rev = merge_attention_all(parts[::-1])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), out_rev.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_rev, atol=1e-5, rtol=1e-5)


def test_shape_errors():
    out = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="same"):
        merge_attention(out, torch.zeros(2, 3), torch.zeros(4, 2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="lse must be"):
        merge_attention(out, torch.zeros(3, 2), out, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="at least one"):
        merge_attention_all([])
