"""Triton LSE merge (kernels/triton_merge.py) against the torch reference and the exact union."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
tm = pytest.importorskip("tetris.kernels.triton_merge")
from tetris.kernels import triton_attention as ta  # noqa: E402

if not ta.INTERPRETED and not torch.cuda.is_available():
    pytest.skip("triton kernels need CUDA or TRITON_INTERPRET=1 at import", allow_module_level=True)

DEVICE = "cpu" if ta.INTERPRETED else "cuda"


def _partial(t, h, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, d, generator=g).to(dtype).to(DEVICE), (torch.randn(h, t, generator=g) * 3).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference_with_neg_inf_rows(dtype):
    out_a, lse_a = _partial(21, 3, 24, 0, dtype)
    out_b, lse_b = _partial(21, 3, 24, 1, dtype)
    lse_a[0, :5] = float("-inf")  # only b saw keys
    lse_b[1, 3:9] = float("-inf")  # only a saw keys
    lse_a[2, 10:12] = float("-inf")
    lse_b[2, 10:12] = float("-inf")  # neither saw keys
    out, lse = tm.merge_attention(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = tm.merge_attention_reference(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out[:5, 0].float(), out_b[:5, 0].float(), atol=tol, rtol=tol)  # a empty: b as is
    assert (out[10:12, 2] == 0).all() and torch.isneginf(lse[2, 10:12]).all()


def test_agrees_with_torch_merge():
    torch_merge = pytest.importorskip("tetris.kernels.merge")
    out_a, lse_a = _partial(9, 2, 16, 4)
    out_b, lse_b = _partial(9, 2, 16, 5)
    lse_b[0, 0] = float("-inf")
    got = tm.merge_attention(out_a, lse_a, out_b, lse_b)
    want = torch_merge.merge_attention(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_merging_two_key_halves_equals_attention_over_all_keys():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(10, 2, 16, generator=g).to(DEVICE)
    k = torch.randn(30, 2, 16, generator=g).to(DEVICE)
    v = torch.randn(30, 2, 16, generator=g).to(DEVICE)
    a = ta.attention_with_lse(q, k[:13], v[:13])
    b = ta.attention_with_lse(q, k[13:], v[13:])
    out, lse = tm.merge_attention(*a, *b)
    want_out, want_lse = ta.attention_with_lse_reference(q, k, v)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_strided_lse_inputs():
    out_a, lse_a = _partial(6, 2, 16, 8)
    out_b, _ = _partial(6, 2, 16, 9)
    lse_b = torch.randn(6, 2).to(DEVICE).t()  # [H, T] view with strides (1, 2)
    got = tm.merge_attention(out_a, lse_a, out_b, lse_b)
    want = tm.merge_attention_reference(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_bad_inputs_raise_value_error():
    out_a, lse_a = _partial(6, 2, 16, 0)
    out_b, lse_b = _partial(6, 2, 16, 1)
    with pytest.raises(ValueError, match="same|one"):
        tm.merge_attention(out_a, lse_a, out_b[:5], lse_b)
    with pytest.raises(ValueError, match=r"\[H, T\]"):
        tm.merge_attention(out_a, lse_a.t(), out_b, lse_b)
    with pytest.raises(ValueError, match="float32"):
        tm.merge_attention(out_a, lse_a.half(), out_b, lse_b)
