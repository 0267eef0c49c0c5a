"""Merge partial attention results over disjoint key sets by their log-sum-exp.

If ``out_a`` is softmax attention over key set A with row log-sum-exp ``lse_a`` (and likewise
for B), attention over A ∪ B is

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

(the online-softmax identity that flash attention and ring attention rely on). A side with
lse = -inf saw no key and contributes nothing; if both are -inf the result is out = 0,
lse = -inf, so merging in any order over ring steps is safe.

Shapes: out_* [T, H, D] (any float dtype), lse_* [H, T] float32. The result has out_a's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["merge_attention", "merge_attention_all"]


def _check(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.shape != out_b.shape or out_a.dim() != 3:
        raise ValueError(
            f"merge needs two outputs of the same [T, H, D] shape; got {tuple(out_a.shape)} "
            f"and {tuple(out_b.shape)}"
        )
    t, h, _ = out_a.shape
    if lse_a.shape != (h, t) or lse_b.shape != (h, t):
        raise ValueError(
            f"lse must be [H, T] = [{h}, {t}]; got {tuple(lse_a.shape)} and {tuple(lse_b.shape)}"
        )


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions; returns (out [T, H, D], lse [H, T] float32)."""
    _check(out_a, lse_a, out_b, lse_b)
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    # Rows empty on both sides: shift by 0 so both weights are exp(-inf) = 0, not NaN.
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - shift).transpose(0, 1).unsqueeze(-1)  # [T, H, 1]
    w_b = torch.exp(lse_b - shift).transpose(0, 1).unsqueeze(-1)
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse


def merge_attention_all(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """Fold ``merge_attention`` over a non-empty list of (out, lse) partials, in list order."""
    if not parts:
        raise ValueError("merge_attention_all needs at least one partial result")
    out, lse = parts[0]
    for o, l in parts[1:]:
        out, lse = merge_attention(out, lse, o, l)
    return out, lse
