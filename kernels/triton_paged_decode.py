"""Triton paged decode attention, split-K (flash-decoding style).

A decode step has one query token per sequence, so a program per (sequence, head) would leave
most of the GPU idle on long contexts. The context is split into partitions of PARTITION
tokens: phase 1 runs one program per (sequence, KV head, partition) that attends the KV head's
whole query-head group to its partition (online softmax) and writes a partial output and LSE;
phase 2 merges the partials of each (sequence, query head) by log-sum-exp, the same identity
as `triton_merge`.

The partition count comes from the block table's width (MAXB * BS), never from the context
lengths, so a launch reads no device value on the host and can be captured in a CUDA graph.
Partitions past a sequence's length write lse = -inf and weigh nothing.

Same signature as `tetris.kernels.paged_decode.paged_decode_attention` (the torch path), plus an
optional keyword `partition_size`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tetris.kernels.triton_attention import (
    INTERPRETED,
    SUPPORTED_DTYPES,
    check_launchable,
    finish_softmax,
    online_softmax_step,
)

DEFAULT_PARTITION = 512
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_partition_kernel(
    Q, KC, VC, BT, CL, PART_OUT, PART_LSE,
    # q [B, Hq, D]; k/v cache [NB, BS, Hkv, D]; block table int32 [B, MAXB]; context lens int32 [B]
    # part_out fp32 [B, Hq, NP, D]; part_lse fp32 [B, Hq, NP]
    stride_qb, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_bt,
    stride_pob, stride_poh, stride_pop, stride_plb, stride_plh,
    max_context, qk_scale_log2,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to tl.dot's 16-row minimum
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per cache block (BS)
    PARTITION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter + bf16: multiply in fp32 (its tl.dot mishandles bf16)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context = tl.minimum(tl.load(CL + seq), max_context)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_valid = offs_g < GROUP
    d_valid = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    start = part * PARTITION
    end = tl.minimum(start + PARTITION, context)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        # Token n of the sequence lives in cache block BT[seq, n // PAGE] at slot n % PAGE.
        block = tl.load(BT + seq * stride_bt + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
        slot = offs_n % PAGE
        kt = tl.load(KC + block[None, :] * stride_kn + slot[None, :] * stride_ks + kv_head * stride_kh
                     + offs_d[:, None], mask=n_valid[None, :] & d_valid[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(VC + block[:, None] * stride_vn + slot[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :], mask=n_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = online_softmax_step(q, kt, v, n_valid[None, :], m_i, l_i, acc, qk_scale_log2, IEEE)

    out, lse = finish_softmax(m_i, l_i, acc)
    tl.store(PART_OUT + seq * stride_pob + heads[:, None] * stride_poh + part * stride_pop + offs_d[None, :],
             out, mask=g_valid[:, None] & d_valid[None, :])
    tl.store(PART_LSE + seq * stride_plb + heads * stride_plh + part, lse, mask=g_valid)


@triton.jit
def _decode_reduce_kernel(
    PART_OUT, PART_LSE, OUT,  # part_out fp32 [B, Hq, NP, D]; part_lse fp32 [B, Hq, NP]; out [B, Hq, D]
    stride_pob, stride_poh, stride_pop, stride_plb, stride_plh, stride_ob, stride_oh,
    NUM_PARTS: tl.constexpr,
    BLOCK_P: tl.constexpr,  # NUM_PARTS padded to a power of two
    CHUNK_P: tl.constexpr,  # partitions summed per step, bounding the [CHUNK_P, BLOCK_D] tile
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    lse_base = PART_LSE + seq * stride_plb + head * stride_plh
    offs_p = tl.arange(0, BLOCK_P)
    lse_all = tl.load(lse_base + offs_p, mask=offs_p < NUM_PARTS, other=float("-inf"))
    m = tl.max(lse_all, axis=0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)  # empty context: all weights exp(-inf) = 0
    total = tl.sum(tl.exp(lse_all - m_shift), axis=0)

    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p0 in range(0, NUM_PARTS, CHUNK_P):
        offs_c = p0 + tl.arange(0, CHUNK_P)
        c_valid = offs_c < NUM_PARTS
        w = tl.exp(tl.load(lse_base + offs_c, mask=c_valid, other=float("-inf")) - m_shift)
        o = tl.load(PART_OUT + seq * stride_pob + head * stride_poh + offs_c[:, None] * stride_pop
                    + offs_d[None, :], mask=c_valid[:, None] & d_valid[None, :], other=0.0)
        acc += tl.sum(o * w[:, None], axis=0)
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + seq * stride_ob + head * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_valid)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(q, k_cache, v_cache, block_tables, context_lens) -> None:
    def fail(msg: str) -> None:
        raise ValueError(msg)

    if q.dim() != 3:
        fail(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        fail(f"k/v cache must both be [NB, BS, Hkv, D]; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    b, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    if dk != d:
        fail(f"head_dim differs: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    if hkv == 0 or hq % hkv:
        fail(f"GQA needs Hq % Hkv == 0, got Hq={hq}, Hkv={hkv}")
    if not _is_pow2(bs):
        fail(f"cache block size must be a power of two, got cache shape {tuple(k_cache.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        fail(f"dtypes must match and be fp16/bf16/fp32: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != b:
        fail(f"block_tables must be int32 [B={b}, MAXB], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (b,):
        fail(f"context_lens must be int32 [B={b}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            fail(f"{name} needs a contiguous last dim, strides {t.stride()}")
    devices = {str(t.device) for t in (q, k_cache, v_cache, block_tables, context_lens)}
    if len(devices) != 1:
        fail(f"inputs lie on several devices: {sorted(devices)}")
    if context_lens.device.type == "cpu" and b:
        # Host-side bound check only where it costs no device sync (and so never while capturing).
        limit = block_tables.shape[1] * bs
        if int(context_lens.min()) < 0 or int(context_lens.max()) > limit:
            fail(f"context_lens must lie in [0, MAXB*BS={limit}], got {context_lens.tolist()}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    *,
    partition_size: int | None = None,
) -> torch.Tensor:
    """One decode step: q [B, Hq, D] over each sequence's paged KV -> out [B, Hq, D] in q.dtype.

    Sequence b's token n is at k_cache[block_tables[b, n // BS], n % BS]; it attends to its first
    context_lens[b] tokens. A sequence with context 0 gets zeros.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    check_launchable(q.device)
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    partition = DEFAULT_PARTITION if partition_size is None else int(partition_size)
    if not _is_pow2(partition) or partition < 16:
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    out = torch.zeros((b, hq, d), dtype=q.dtype, device=q.device)
    max_context = block_tables.shape[1] * page
    if b == 0 or max_context == 0:
        return out
    num_parts = triton.cdiv(max_context, partition)
    part_out = torch.empty((b, hq, num_parts, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, hq, num_parts), dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    block_n = min(partition, 64)
    _decode_partition_kernel[(b, hkv, num_parts)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        max_context, scale * _LOG2E,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_D=block_d,
        PAGE=page, PARTITION=partition, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        UPCAST=INTERPRETED and q.dtype == torch.bfloat16,
    )
    block_p = triton.next_power_of_2(num_parts)
    _decode_reduce_kernel[(b, hq)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_PARTS=num_parts, BLOCK_P=block_p, CHUNK_P=min(block_p, 16), HEAD_DIM=d, BLOCK_D=block_d,
    )
    return out


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """fp32 torch reference: gathers each sequence's keys and runs plain softmax attention."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.zeros((b, hq, d), dtype=torch.float32, device=q.device)
    for i, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        tokens = torch.arange(n, device=q.device)
        blocks = block_tables[i, tokens // page].long()
        k = k_cache[blocks, tokens % page].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_cache[blocks, tokens % page].float().repeat_interleave(hq // hkv, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", probs, v)
    return out.to(q.dtype)
