"""Attention that also returns the log-sum-exp (LSE) of each query row.

The LSE is what lets partial attention results over disjoint key sets be merged exactly
(``kernels/merge.py``): ring attention computes one partial per ring step and merges them.

Shapes (flat "varlen" token layout, one sequence per call):
    q    [Tq, Hq, D]      k, v [Tk, Hkv, D]      Hq % Hkv == 0 (grouped-query attention)
    out  [Tq, Hq, D]  in q.dtype
    lse  [Hq, Tq]     float32, natural log; -inf for a query row that sees no key

Masks:
    causal=True, no positions   standard causal, Tq == Tk (query i sees keys 0..i)
    q_positions / k_positions   absolute-position mask: key j is visible to query i iff
                                k_positions[j] <= q_positions[i]. Both must be given; the
                                mask applies whatever ``causal`` says (a ring step over a
                                history shard simply has every key in the past).
    neither                     full (non-causal) attention

Implementations with this exact signature:
    attention_with_lse_ref        explicit fp32 softmax; the oracle for every other path
    attention_with_lse            torch path: fp32 math in query blocks (bounded memory)
    attention_with_lse_cpu_flash  aten's CPU flash kernel (position masks as additive masks)
``kernels/dispatch.py`` picks one by capability.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "attention_with_lse",
    "attention_with_lse_ref",
    "attention_with_lse_cpu_flash",
    "cpu_flash_supports",
    "check_attention_inputs",
]

# Query rows per block of the torch path: bounds the [Hq, block, Tk] fp32 score tensor.
_QUERY_BLOCK = 512


def check_attention_inputs(q, k, v, causal, q_positions, k_positions) -> None:
    """Raise ValueError with a clear message when shapes or masks do not fit together."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"attention expects q [Tq, Hq, D], k/v [Tk, Hkv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim mismatch: q has D={q.shape[2]}, k has D={k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})"
        )
    if (q_positions is None) != (k_positions is None):
        raise ValueError("q_positions and k_positions must be given together")
    if q_positions is not None:
        if q_positions.shape != (q.shape[0],) or k_positions.shape != (k.shape[0],):
            raise ValueError(
                f"positions must be [Tq]={q.shape[0]} and [Tk]={k.shape[0]}; got "
                f"{tuple(q_positions.shape)} and {tuple(k_positions.shape)}"
            )
    elif causal and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"causal=True without positions needs Tq == Tk (got {q.shape[0]} and {k.shape[0]}); "
            "pass q_positions/k_positions for any other alignment"
        )


def _visible(q_positions, k_positions, causal, tq, tk, device) -> torch.Tensor | None:
    """[Tq, Tk] bool visibility, or None when every key is visible."""
    if q_positions is not None:
        return k_positions.to(device)[None, :] <= q_positions.to(device)[:, None]
    if causal:
        return torch.ones(tq, tk, dtype=torch.bool, device=device).tril()
    return None


def _softmax_with_lse(scores: torch.Tensor, vf: torch.Tensor):
    """scores [Hq, Tq, Tk] fp32 with -inf at hidden keys; vf [Hq, Tk, D] fp32."""
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Tq]; -inf where the row is all hidden
    # Subtracting -inf from -inf is NaN; shift empty rows by 0 instead so they weigh 0.
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - shift[..., None])
    return probs @ vf, lse


def attention_with_lse_ref(q, k, v, *, causal=False, q_positions=None, k_positions=None,
                           scale=None):
    """Explicit fp32 attention: materialises the whole [Hq, Tq, Tk] score matrix."""
    check_attention_inputs(q, k, v, causal, q_positions, k_positions)
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [Hq, Tq, Tk]
    mask = _visible(q_positions, k_positions, causal, tq, tk, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out, lse = _softmax_with_lse(scores, vf)
    return out.transpose(0, 1).to(q.dtype), lse


def attention_with_lse(q, k, v, *, causal=False, q_positions=None, k_positions=None,
                       scale=None):
    """Torch path: fp32 math over blocks of queries, each block against all keys.

    Keys are grouped per KV head ([Hkv, group, ...] views) so GQA never copies K or V.
    """
    check_attention_inputs(q, k, v, causal, q_positions, k_positions)
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = hq // hkv
    out = torch.empty(tq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(hq, tq, dtype=torch.float32, device=q.device)
    kf = k.float().permute(1, 2, 0)  # [Hkv, D, Tk]
    vf = v.float().transpose(0, 1)  # [Hkv, Tk, D]
    mask = _visible(q_positions, k_positions, causal, tq, tk, q.device)
    for s in range(0, tq, _QUERY_BLOCK):
        e = min(s + _QUERY_BLOCK, tq)
        # [Tb, Hq, D] -> [Hkv, group*Tb, D]: query heads sharing a KV head share one matmul.
        qb = q[s:e].float().reshape(e - s, hkv, group, d).permute(1, 2, 0, 3)
        qb = qb.reshape(hkv, group * (e - s), d)
        scores = (qb @ kf) * scale  # [Hkv, group*Tb, Tk]
        scores = scores.view(hkv, group, e - s, tk)
        if mask is not None:
            scores = scores.masked_fill(~mask[s:e], float("-inf"))
        scores = scores.view(hkv, group * (e - s), tk)
        ob, lb = _softmax_with_lse(scores, vf)  # [Hkv, group*Tb, D], [Hkv, group*Tb]
        out[s:e] = ob.view(hkv, group, e - s, d).permute(2, 0, 1, 3).reshape(e - s, hq, d)
        lse[:, s:e] = lb.view(hq, e - s)
    return out, lse


def cpu_flash_supports(q, k, causal, q_positions, k_positions) -> bool:
    """Whether aten's CPU flash kernel can compute this call (CPU, float dtypes)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and q.dtype == k.dtype
    )


def attention_with_lse_cpu_flash(q, k, v, *, causal=False, q_positions=None, k_positions=None,
                                 scale=None):
    """aten._scaled_dot_product_flash_attention_for_cpu, which returns the LSE as well.

    No mask and plain causal go to the kernel directly. A position mask becomes an additive
    -inf mask, built for one block of queries at a time to bound its [block, Tk] memory; query
    rows that see no key are then set to out = 0, lse = -inf (the kernel reports lse = 0).
    K/V are expanded to Hq heads because the kernel has no GQA support.
    """
    check_attention_inputs(q, k, v, causal, q_positions, k_positions)
    if not cpu_flash_supports(q, k, causal, q_positions, k_positions):
        raise ValueError("the CPU flash path needs CPU tensors of one float dtype")
    tq, hq, d = q.shape
    if tq == 0 or k.shape[0] == 0:  # the aten kernel does not accept empty sequences
        return (torch.zeros(tq, hq, d, dtype=q.dtype),
                torch.full((hq, tq), float("-inf"), dtype=torch.float32))
    group = hq // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # [T, H, D] -> [1, H, T, D] views; the kernel accepts strided inputs.
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if q_positions is None:
        out, lse = flash(qb, kb, vb, 0.0, causal, scale=scale)[:2]
        return out[0].transpose(0, 1), lse[0].float()
    out = torch.empty(tq, hq, d, dtype=q.dtype)
    lse = torch.empty(hq, tq, dtype=torch.float32)
    for s in range(0, tq, _QUERY_BLOCK):
        e = min(s + _QUERY_BLOCK, tq)
        visible = _visible(q_positions[s:e], k_positions, True, e - s, k.shape[0], q.device)
        mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
        ob, lb = flash(qb[:, :, s:e], kb, vb, 0.0, False, attn_mask=mask[None, None],
                       scale=scale)[:2]
        empty = ~visible.any(dim=1)  # [Tb]
        out[s:e] = ob[0].transpose(0, 1).masked_fill(empty[:, None, None], 0.0)
        lse[:, s:e] = lb[0].float().masked_fill(empty[None, :], float("-inf"))
    return out, lse
