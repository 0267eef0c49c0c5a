"""Paged KV cache: writing K/V into blocks and single-query (decode) attention over them.

Cache layout per layer (vLLM-style):
    k_cache, v_cache   [NB, BS, Hkv, D]     NB blocks of BS token slots
    slot               block * BS + offset   (a flat index into [NB * BS])
    block_tables       int32 [B, MAXB]       a sequence's blocks, in token order
    context_lens       int32 [B]             tokens of each sequence in the cache (its own
                                             newest token included: write_kv before attention)
Table entries past a sequence's last block may hold anything; they are never read as keys.
"""

from __future__ import annotations

import math

import msgspec
import torch
import torch.nn.functional as F

__all__ = [
    "write_kv",
    "paged_decode_attention",
    "paged_decode_attention_with_lse",
    "DecodeMeta",
    "decode_meta",
    "paged_decode_attention_meta",
]


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, check_bounds: bool = True) -> None:
    """Store k, v [T, Hkv, D] at ``slot_mapping`` int64 [T] of the caches (in place).

    ``check_bounds=False`` skips the range check, which reads the slots back to the host (a
    device sync on GPU, and unusable inside a CUDA graph); callers that built the slots from
    their own block tables pass it.
    """
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            f"caches must both be [NB, BS, Hkv, D]; got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    nb, bs, hkv, d = k_cache.shape
    t = k.shape[0]
    if k.shape != (t, hkv, d) or v.shape != (t, hkv, d):
        raise ValueError(
            f"k/v must be [T, Hkv, D] = [{t}, {hkv}, {d}]; got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping must be [T]={t}, got {tuple(slot_mapping.shape)}")
    if t == 0:
        return
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
    if check_bounds:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= nb * bs:
            raise ValueError(f"slot_mapping holds slots outside [0, {nb * bs}): min {lo}, max {hi}")
    k_cache.view(nb * bs, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(nb * bs, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))


def _check(q, k_cache, v_cache, block_tables, context_lens) -> int:
    """Validate shapes; returns the longest context length (0 for an empty batch)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [B, Hq, D] and caches [NB, BS, Hkv, D]; got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    b, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    if d != dk or hq % hkv:
        raise ValueError(f"q heads/dim ({hq}, {d}) do not fit cache heads/dim ({hkv}, {dk})")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(
            f"block_tables must be [B={b}, MAXB] and context_lens [B]; got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    longest = int(context_lens.max()) if b else 0
    if longest > block_tables.shape[1] * bs:
        raise ValueError(
            f"a context length ({longest}) exceeds the block table's capacity "
            f"({block_tables.shape[1]} blocks x {bs})"
        )
    return longest


def paged_decode_attention_with_lse(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """One query per sequence against its cached keys -> (out [B, Hq, D], lse [B, Hq] fp32).

    Torch path: gathers each sequence's blocks into [B, L, Hkv, D] (L = longest context,
    rounded up to whole blocks) and masks slots past each context length. A sequence with
    context length 0 gets out = 0, lse = -inf.
    """
    longest = _check(q, k_cache, v_cache, block_tables, context_lens)
    b, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if b == 0:
        return q.new_zeros(0, hq, d), torch.zeros(0, hq, dtype=torch.float32, device=q.device)
    lens = context_lens.to(device=q.device, dtype=torch.int64)
    nblk = max(1, -(-longest // bs))
    tables = block_tables[:, :nblk].to(device=q.device, dtype=torch.int64).clamp(0, nb - 1)
    keys = k_cache[tables].view(b, nblk * bs, hkv, d).float()  # [B, L, Hkv, D]
    vals = v_cache[tables].view(b, nblk * bs, hkv, d).float()
    qg = q.float().view(b, hkv, group, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * scale  # [B, Hkv, group, L]
    hidden = torch.arange(nblk * bs, device=q.device)[None, :] >= lens[:, None]  # [B, L]
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, group]
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - shift[..., None])
    out = torch.einsum("bhgl,blhd->bhgd", probs, vals)
    return out.reshape(b, hq, d).to(q.dtype), lse.reshape(b, hq)


class DecodeMeta(msgspec.Struct):
    """What every layer's decode attention of one step shares: built once per step.

    tables  int64 [B * nblk]  each row's first nblk blocks (enough for the longest context),
                              clamped into the cache, flattened for one index_select
    visible fp32 [B, 1, 1, L] additive SDPA mask: 0 for a visible slot, -inf past the
                              context (L = nblk * BS); an empty row sees slot 0
    empty   bool [B]          rows with context length 0 (their output is zeroed), or None
    """

    tables: torch.Tensor
    visible: torch.Tensor
    empty: torch.Tensor | None


def decode_meta(block_tables, context_lens, block_size: int, num_blocks: int,
                longest: int) -> DecodeMeta:
    """The shared part of ``paged_decode_attention`` for contexts of at most ``longest``.

    The mask is additive (what SDPA turns a boolean mask into on every call anyway), so the
    conversion happens once per step instead of once per layer.
    """
    nblk = max(1, -(-longest // block_size))
    dev = block_tables.device
    tables = block_tables[:, :nblk].to(torch.int64).clamp(0, num_blocks - 1).reshape(-1)
    lens = context_lens.to(device=dev, dtype=torch.int64)
    visible = torch.arange(nblk * block_size, device=dev)[None, :] < lens[:, None]  # [B, L]
    empty = lens == 0
    # An all-hidden row would make SDPA return NaN: let it see slot 0, then zero it.
    if bool(empty.any()):
        visible[:, 0] |= empty
    else:
        empty = None
    additive = torch.zeros(visible.shape, device=dev).masked_fill_(~visible, float("-inf"))
    return DecodeMeta(tables=tables, visible=additive[:, None, None, :], empty=empty)


def paged_decode_attention_meta(q, k_cache, v_cache, meta: DecodeMeta, scale=None):
    """``paged_decode_attention`` with the step's shared tensors precomputed (torch path).

    One batched SDPA: the gathered keys are viewed as [B, Hkv, L, D] (no copy) and each KV
    head's ``group`` query heads take the place of SDPA's query length, so GQA needs no key
    expansion.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    if b == 0:
        return q.new_zeros(0, hq, d)
    length = meta.visible.shape[-1]
    if q.dtype in _HALF and k_cache.dtype == q.dtype and q.device.type == "cpu":
        return _half_decode_attention(q, k_cache, v_cache, meta, scale)
    # fp32 math whatever the cache dtype, like the LSE path.
    keys = _gather(k_cache, meta, b, length).float()
    vals = _gather(v_cache, meta, b, length).float()
    qg = q.reshape(b, hkv, hq // hkv, d).float()  # [B, Hkv, group, D]
    out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=meta.visible, scale=scale)
    return _zero_empty(out, meta).reshape(b, hq, d).to(q.dtype)


def _gather(cache, meta: DecodeMeta, b: int, length: int):
    """[NB, BS, Hkv, D] -> each sequence's blocks as [B, Hkv, L, D] (a view of one copy).

    index_select copies whole blocks; advanced indexing (cache[tables]) is several times slower
    on CPU for the same gather.
    """
    hkv, d = cache.shape[2], cache.shape[3]
    return cache.index_select(0, meta.tables).view(b, length, hkv, d).transpose(1, 2)


def _zero_empty(out, meta: DecodeMeta):
    """Sequences with no visible key attend to nothing: zeros, not a softmax over -inf."""
    if meta.empty is None:
        return out
    return out.masked_fill(meta.empty[:, None, None, None], 0.0)


_HALF = (torch.bfloat16, torch.float16)


def _half_decode_attention(q, k_cache, v_cache, meta: DecodeMeta, scale=None):
    """bf16/fp16 decode attention on CPU: half-precision GEMMs, fp32 softmax.

    The numerics of transformers' eager Llama attention: both products run in the cache dtype
    (oneDNN accumulates in fp32 and rounds the result once), the scaled, masked scores are
    softmaxed in fp32 and rounded back for the product with V. Upcasting the gathered K/V to
    fp32 instead cost more than the attention itself at decode shapes (bench_decode, bf16).
    q [B, Hq, D]; caches [NB, BS, Hkv, D]; keys/values gathered as [B, Hkv, L, D].
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    length = meta.visible.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # Contiguous per-head copies: strided operands made matmul several times slower.
    keys = _gather(k_cache, meta, b, length).contiguous()
    vals = _gather(v_cache, meta, b, length).contiguous()
    qg = q.reshape(b, hkv, hq // hkv, d)  # [B, Hkv, group, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [B, Hkv, group, L]
    probs = torch.softmax(scores.mul_(scale).add_(meta.visible), dim=-1).to(q.dtype)
    out = torch.matmul(probs, vals)  # [B, Hkv, group, D]
    return _zero_empty(out, meta).reshape(b, hq, d)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """q [B, Hq, D] against the paged cache -> out [B, Hq, D] in q.dtype.

    A context of length 0 gets out = 0. Callers running many layers of one step can build
    ``decode_meta`` once and call ``paged_decode_attention_meta`` per layer instead.
    """
    longest = _check(q, k_cache, v_cache, block_tables, context_lens)
    if q.shape[0] == 0:
        return q.new_zeros(0, *q.shape[1:])
    nb, bs = k_cache.shape[:2]
    meta = decode_meta(block_tables.to(q.device), context_lens, bs, nb, longest)
    return paged_decode_attention_meta(q, k_cache, v_cache, meta, scale)
