"""flash-attn backend wrappers (kernels/flash_attn_backend.py).

flash-attn is CUDA-only and absent here, so the mask decomposition is tested with a torch
stand-in that has flash-attn's semantics (causal with Tq != Tk aligned bottom-right); the
real library is exercised in tests/gpu/ when it is installed.
"""

from __future__ import annotations

import pytest
import torch

from tetris.kernels import flash_attn_backend as fab
from tetris.kernels.attention import attention_with_lse_ref

_calls: list[tuple[int, int, bool]] = []


def _flash_like_step(q, k, v, causal, scale):
    """Torch stand-in for one flash-attn call: bottom-right causal alignment when Tq != Tk."""
    _calls.append((q.shape[0], k.shape[0], causal))
    assert q.shape[0] > 0 and k.shape[0] > 0, "flash-attn is never called on an empty piece"
    if causal:
        tq, tk = q.shape[0], k.shape[0]
        qp = torch.arange(tq) + (tk - tq)
        return attention_with_lse_ref(q, k, v, q_positions=qp, k_positions=torch.arange(tk), scale=scale)
    return attention_with_lse_ref(q, k, v, scale=scale)


def _qkv(tq, tk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tq, 4, 16, generator=g), torch.randn(tk, 2, 16, generator=g),
            torch.randn(tk, 2, 16, generator=g))


def _zigzag(offset, chunk, members, r):
    piece = chunk // (2 * members)
    j = 2 * members - 1 - r
    return torch.tensor(list(range(r * piece, (r + 1) * piece)) + list(range(j * piece, (j + 1) * piece))) + offset


def test_position_runs():
    assert fab.position_runs(torch.tensor([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 5, 9), (5, 6, 2)]
    assert fab.position_runs(torch.tensor([], dtype=torch.int64)) == []


@pytest.mark.parametrize("r_q, r_k", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_zigzag_step_by_flash_pieces_matches_reference(r_q, r_k):
    q_pos, k_pos = _zigzag(8, 32, 2, r_q), _zigzag(8, 32, 2, r_k)
    q, k, v = _qkv(len(q_pos), len(k_pos), seed=r_q * 2 + r_k)
    _calls.clear()
    out, lse = fab.attention_with_lse_by_flash(q, k, v, q_positions=q_pos, k_positions=k_pos,
                                               step=_flash_like_step)
    want_out, want_lse = attention_with_lse_ref(q, k, v, q_positions=q_pos, k_positions=k_pos)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-5, rtol=1e-5)
    assert 1 <= len(_calls) <= 6  # two runs each side: at most 2 x 2 pairs, few pieces


def test_unaligned_runs_and_history_shard():
    q_pos = torch.tensor([5, 6, 7, 8, 20, 21, 22])
    k_pos = torch.tensor([0, 1, 2, 7, 8, 9, 10, 21])
    q, k, v = _qkv(7, 8, seed=4)
    out, lse = fab.attention_with_lse_by_flash(q, k, v, q_positions=q_pos, k_positions=k_pos,
                                               step=_flash_like_step)
    want_out, want_lse = attention_with_lse_ref(q, k, v, q_positions=q_pos, k_positions=k_pos)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    # Without positions the wrapper is one flash call with the caller's mask.
    _calls.clear()
    out, _ = fab.attention_with_lse_by_flash(q, k, v, step=_flash_like_step)
    torch.testing.assert_close(out, attention_with_lse_ref(q, k, v)[0], atol=1e-5, rtol=1e-5)
    assert _calls == [(7, 8, False)]


def test_rows_before_every_key_stay_empty():
    q, k, v = _qkv(3, 4, seed=5)
    out, lse = fab.attention_with_lse_by_flash(q, k, v, q_positions=torch.tensor([0, 1, 2]),
                                               k_positions=torch.tensor([10, 11, 12, 13]),
                                               step=_flash_like_step)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_public_names_exist_only_with_flash_attn():
    has = hasattr(fab, "attention_with_lse") and hasattr(fab, "paged_decode_attention")
    assert has == fab.AVAILABLE
    if not fab.AVAILABLE:
        from tetris.kernels import dispatch

        assert "flash_attn" not in dispatch.available_backends()


def test_flash_decode_supports_needs_cuda_half_and_256_pages():
    q = torch.zeros(2, 4, 16, dtype=torch.float16)
    cache = torch.zeros(1, 256, 2, 16, dtype=torch.float16)
    assert not fab.flash_decode_supports(q, cache)  # CPU tensors
    assert not fab.flash_decode_supports(q.cuda() if torch.cuda.is_available() else q, cache[:, :16])
