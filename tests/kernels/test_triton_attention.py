"""Triton attention step (kernels/triton_attention.py) against the fp32 torch reference.

Runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py sets it), so shapes stay tiny.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
ta = pytest.importorskip("tetris.kernels.triton_attention")
if not ta.INTERPRETED and not torch.cuda.is_available():
    pytest.skip("triton kernels need CUDA or TRITON_INTERPRET=1 at import", allow_module_level=True)

DEVICE = "cpu" if ta.INTERPRETED else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _qkv(tq, tk, hq=4, hkv=2, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(tk, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(tk, hkv, d, generator=g).to(dtype).to(DEVICE)
    return q, k, v


def _assert_close(got, want, dtype):
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.dtype == ref_out.dtype and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].cpu(), ref_lse[finite].cpu(), atol=1e-4, rtol=1e-4)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref_out.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "causal", "positions"])
def test_matches_reference(dtype, mask):
    tq, tk = (24, 24) if mask == "causal" else (20, 37)
    q, k, v = _qkv(tq, tk, dtype=dtype)
    kw = {}
    if mask == "causal":
        kw["causal"] = True
    elif mask == "positions":
        g = torch.Generator().manual_seed(1)
        kw["q_positions"] = torch.randperm(80, generator=g)[:tq].to(DEVICE)
        kw["k_positions"] = torch.randperm(80, generator=g)[:tk].to(DEVICE)
    got = ta.attention_with_lse(q, k, v, **kw)
    _assert_close(got, ta.attention_with_lse_reference(q, k, v, **kw), dtype)


def test_agrees_with_torch_path_reference():
    ref_mod = pytest.importorskip("tetris.kernels.attention")
    q, k, v = _qkv(33, 33, hq=6, hkv=3, d=16)
    for kw in ({}, {"causal": True}, {"scale": 0.3}):
        _assert_close(ta.attention_with_lse(q, k, v, **kw), ref_mod.attention_with_lse_ref(q, k, v, **kw),
                      torch.float32)


def test_non_power_of_two_head_dim_and_strided_heads():
    q_big, k, v = _qkv(17, 19, hq=8, hkv=2, d=24)
    q = q_big[:, ::2]  # [17, 4, 24] with a head stride of 2*24: not contiguous
    assert not q.is_contiguous()
    _assert_close(ta.attention_with_lse(q, k, v), ta.attention_with_lse_reference(q, k, v), torch.float32)


def test_rows_that_see_no_key_are_zero_with_neg_inf_lse():
    q, k, v = _qkv(8, 16)
    q_pos = torch.arange(8, device=DEVICE)  # queries at 0..7
    k_pos = torch.arange(16, device=DEVICE) + 4  # keys at 4..19
    out, lse = ta.attention_with_lse(q, k, v, q_positions=q_pos, k_positions=k_pos)
    assert torch.isneginf(lse[:, :4]).all() and torch.isfinite(lse[:, 4:]).all()
    assert (out[:4] == 0).all() and (out[4:].abs().sum(-1) > 0).all()
    # Query at position 4 sees exactly one key (position 4): the output is that key's value row.
    torch.testing.assert_close(out[4], v[0].repeat_interleave(2, dim=0))


def test_empty_shard():
    q, k, v = _qkv(5, 0)
    out, lse = ta.attention_with_lse(q, k, v)
    assert out.shape == (5, 4, 32) and (out == 0).all() and torch.isneginf(lse).all()


def _zigzag_pieces(chunk_len, members):
    """Member r holds pieces r and 2s-1-r of 2s equal pieces (SPEC §6)."""
    piece = chunk_len // (2 * members)
    out = []
    for r in range(members):
        idx = list(range(r * piece, (r + 1) * piece))
        j = 2 * members - 1 - r
        idx += list(range(j * piece, (j + 1) * piece))
        out.append(torch.tensor(idx, dtype=torch.int64))
    return out


def test_zigzag_ring_steps_merged_equal_full_causal_attention():
    """History shards unmasked + chunk shards masked by position, merged by LSE == causal attention."""
    from tetris.kernels.triton_merge import merge_attention

    history, chunk, members = 12, 32, 2
    total = history + chunk
    q_all, k_all, v_all = _qkv(total, total, hq=4, hkv=1, d=16, seed=3)
    want_out, want_lse = ta.attention_with_lse_reference(q_all, k_all, v_all, causal=True)
    hist_shards = [torch.arange(0, 6), torch.arange(6, 12)]
    chunk_shards = [history + p for p in _zigzag_pieces(chunk, members)]
    for r in range(members):
        q_idx = chunk_shards[r].to(DEVICE)
        out = lse = None
        steps = [(h, False) for h in hist_shards] + [(c, True) for c in chunk_shards]
        for k_idx, masked in steps:
            k_idx = k_idx.to(DEVICE)
            kw = {"q_positions": q_idx, "k_positions": k_idx} if masked else {}
            o, l = ta.attention_with_lse(q_all[q_idx], k_all[k_idx], v_all[k_idx], **kw)
            out, lse = (o, l) if out is None else merge_attention(out, lse, o, l)
        torch.testing.assert_close(out, want_out[q_idx], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse[:, q_idx], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda q, k, v: (q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1)), "Hq % Hkv"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), "dtype"),
        (lambda q, k, v: (q, k.half(), v), "dtypes differ"),
        (lambda q, k, v: (q[..., :16], k, v), "head_dim"),
        (lambda q, k, v: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v), "contiguous last dim"),
        (lambda q, k, v: (q[0], k, v), r"\[Tq, Hq, D\]"),
    ],
)
def test_bad_inputs_raise_value_error(make, match):
    q, k, v = _qkv(8, 8)
    with pytest.raises(ValueError, match=match):
        ta.attention_with_lse(*make(q, k, v))


def test_bad_masks_raise_value_error():
    q, k, v = _qkv(8, 6)
    with pytest.raises(ValueError, match="Tq == Tk"):
        ta.attention_with_lse(q, k, v, causal=True)
    with pytest.raises(ValueError, match="both"):
        ta.attention_with_lse(q, k, v, q_positions=torch.arange(8, device=DEVICE))
    with pytest.raises(ValueError, match=r"shape \(6,\)"):
        ta.attention_with_lse(q, k, v, q_positions=torch.arange(8, device=DEVICE),
                              k_positions=torch.arange(5, device=DEVICE))


def test_dispatch_routes_to_triton_when_asked(monkeypatch):
    dispatch = pytest.importorskip("tetris.kernels.dispatch")
    if DEVICE == "cpu":
        monkeypatch.setenv("TETRIS_KERNEL_BACKEND", "triton")
    q, k, v = _qkv(12, 12)
    pos = torch.arange(12, device=DEVICE)
    assert dispatch.attention_backend_for(q, k, q_positions=pos, k_positions=pos) == "triton"
    got = dispatch.attention_with_lse(q, k, v, q_positions=pos, k_positions=pos)
    _assert_close(got, ta.attention_with_lse_reference(q, k, v, causal=True), torch.float32)
