"""flash-attn wrappers with the signatures of the torch kernels; used when flash-attn imports.

`kernels/dispatch.py` looks up `attention_with_lse` and `paged_decode_attention` here with
`getattr(module, name, None)`, so those two names exist only when flash-attn is importable:
without it the backend is simply absent (never required). The logic that maps our masks onto
flash-attn's is in always-defined helpers that take the flash call as an argument, so it is
tested on CPU with a torch stand-in that has flash-attn's semantics.

Mapping:
- Attention step (a ring step, SPEC §6): `flash_attn_func(..., return_attn_probs=True)` returns
  the natural-log LSE `[B, H, Tq]` we need. flash-attn has no per-token position mask, but its
  causal mask for Tq != Tk is aligned at the bottom-right (query i sees key j iff
  j <= i + Tk - Tq, flash-attn >= 2.1), and zigzag shards are a few runs of consecutive
  positions. For each (query run, key run) pair, queries before the key run see nothing,
  queries at or past its end see all of it (no mask), and the rest form one causal piece whose
  query and key ranges end at the same position, which is exactly bottom-right alignment.
  The pieces are merged by LSE.
- Paged decode: `flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)`.
  flash-attn 2 needs the cache block size to be a multiple of 256 and half precision; other
  calls go to the Triton kernel (or the torch path without Triton).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tetris.kernels.merge import merge_attention as _merge_torch

try:  # optional: flash-attn 2 (CUDA only)
    from flash_attn import flash_attn_func as _flash_attn_func
    from flash_attn import flash_attn_with_kvcache as _flash_attn_with_kvcache

    AVAILABLE = True
except ImportError:  # also covers a broken CUDA extension inside flash_attn
    _flash_attn_func = _flash_attn_with_kvcache = None
    AVAILABLE = False

# flash-attn 2's paged KV cache: "Paged KV cache block size must be divisible by 256".
PAGE_MULTIPLE = 256
HALF_DTYPES = (torch.float16, torch.bfloat16)

# (q [Tq, Hq, D], k [Tk, Hkv, D], v, causal, scale) -> (out [Tq, Hq, D], lse [Hq, Tq] fp32);
# causal with Tq != Tk is bottom-right aligned, as in flash-attn.
FlashStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


def flash_step(q, k, v, causal: bool, scale: float):
    """One flash-attn call on the flat layout ([T, H, D] <-> [1, T, H, D])."""
    out, lse, _ = _flash_attn_func(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=scale, causal=causal,
        return_attn_probs=True,
    )
    return out[0], lse[0].float()


def position_runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split positions [n] into maximal runs of consecutive values: (first index, end index, first position)."""
    pos = positions.tolist()
    runs = []
    start = 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            runs.append((start, i, pos[start]))
            start = i
    return runs


def _pieces(q_run, k_run):
    """Flash calls for one (query run, key run) pair.

    Returns (query index range, key index range, causal) triples. Positions: queries
    [p0, p1), keys [c0, c1); a query at p sees keys at positions <= p.
    """
    (qi, qe, p0), (ki, ke, c0) = q_run, k_run
    p1, c1 = p0 + (qe - qi), c0 + (ke - ki)
    pieces = []
    lo, hi = max(p0, c0), min(p1, c1)
    if lo < hi:  # queries inside the key range: causal, both ranges ending at position hi - 1
        pieces.append(((qi + lo - p0, qi + hi - p0), (ki, ki + hi - c0), True))
    full_lo = max(p0, c1)
    if full_lo < p1:  # queries past the key range's end see all of it
        pieces.append(((qi + full_lo - p0, qe), (ki, ke), False))
    return pieces


def attention_with_lse_by_flash(q, k, v, *, causal=False, q_positions=None, k_positions=None,
                                scale=None, step: FlashStep | None = None, merge=_merge_torch):
    """`attention_with_lse` built from flash calls (see the module docstring); `step` defaults to flash-attn."""
    from tetris.kernels.attention import check_attention_inputs

    check_attention_inputs(q, k, v, causal, q_positions, k_positions)
    step = flash_step if step is None else step
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    tq, hq, d = q.shape
    if q_positions is None:
        if k.shape[0] == 0:
            return q.new_zeros(tq, hq, d), torch.full((hq, tq), float("-inf"), device=q.device)
        return step(q, k, v, causal, scale)
    out = q.new_zeros(tq, hq, d)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    k_runs = position_runs(k_positions)
    for q_run in position_runs(q_positions):
        for k_run in k_runs:
            for (qa, qb), (ka, kb), piece_causal in _pieces(q_run, k_run):
                o, l = step(q[qa:qb], k[ka:kb], v[ka:kb], piece_causal, scale)
                out[qa:qb], lse[:, qa:qb] = merge(out[qa:qb], lse[:, qa:qb], o, l)
    return out, lse


def flash_decode_supports(q, k_cache) -> bool:
    """Whether flash-attn's paged KV kernel can run this decode step."""
    return (AVAILABLE and q.device.type == "cuda" and q.dtype in HALF_DTYPES
            and k_cache.dtype == q.dtype and k_cache.shape[1] % PAGE_MULTIPLE == 0)


def _fallback_decode():
    try:
        from tetris.kernels.triton_paged_decode import paged_decode_attention as fn
    except ImportError:
        from tetris.kernels.paged_decode import paged_decode_attention as fn
    return fn


def _attention_with_lse(q, k, v, *, causal=False, q_positions=None, k_positions=None, scale=None):
    """flash-attn attention step; fp32 or CPU inputs go to the Triton (or torch) path instead."""
    if q.device.type != "cuda" or q.dtype not in HALF_DTYPES:
        try:
            from tetris.kernels.triton_attention import attention_with_lse as fallback
        except ImportError:
            from tetris.kernels.attention import attention_with_lse as fallback
        return fallback(q, k, v, causal=causal, q_positions=q_positions, k_positions=k_positions,
                        scale=scale)
    return attention_with_lse_by_flash(q, k, v, causal=causal, q_positions=q_positions,
                                       k_positions=k_positions, scale=scale)


def _paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """q [B, Hq, D] over the paged cache -> [B, Hq, D]; flash-attn where it fits, else Triton."""
    if not flash_decode_supports(q, k_cache):
        return _fallback_decode()(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = _flash_attn_with_kvcache(
        q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens, block_table=block_tables,
        softmax_scale=scale, causal=False,
    )[:, 0]
    # A sequence with no context must give zeros (the torch contract); no host sync here.
    return torch.where((context_lens > 0)[:, None, None], out, torch.zeros_like(out))


if AVAILABLE:  # the names dispatch looks up exist only with flash-attn
    attention_with_lse = _attention_with_lse
    paged_decode_attention = _paged_decode_attention
