"""Triton attention step with log-sum-exp: queries against one KV shard (SPEC §6, ring attention).

One ring step attends a member's queries to one KV shard, either unmasked (a history shard,
wholly in the past) or masked by absolute token position (a shard of the current chunk in the
zigzag layout, where positions are not one contiguous range). The partial results of all steps
are merged by their log-sum-exp (`triton_merge.merge_attention`), so the step returns the
natural-log LSE alongside the normalised output.

Kernel: a tiled online softmax (FlashAttention-2 style). One program owns BLOCK_M queries of one
query head and walks the shard's keys BLOCK_N at a time, keeping a running max `m`, running sum
`l` and an unnormalised accumulator. Scores are kept in base 2 (scale folded with log2 e) so
the kernel uses exp2; the LSE is converted back to natural log at the end.

Same signature as `tetris.kernels.attention.attention_with_lse` (the torch path).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

# Whether the kernels below were built for the interpreter: triton decides at decoration time.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


@triton.jit
def online_softmax_step(q, kt, v, visible, m_i, l_i, acc, qk_scale_log2, IEEE: tl.constexpr):
    """Fold one key tile into the running (max m, sum l, accumulator) of FlashAttention-2.

    q [M, D], kt [D, N], v [N, D], visible [M, N] bool; m_i, l_i [M] fp32 (base-2 units),
    acc [M, D] fp32. Returns the updated (m_i, l_i, acc).
    """
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = tl.where(visible, s * qk_scale_log2, float("-inf"))  # [M, N], base-2 logits
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have seen no key yet keep m = -inf; shift by 0 there to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def finish_softmax(m_i, l_i, acc):
    """Normalise the accumulator -> (out [M, D] fp32, natural-log lse [M]); -inf / 0 where no key was seen."""
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    # lse = ln(sum exp(logit)) = (m + log2 l) * ln 2 with m in base-2 units.
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def _attention_step_kernel(
    Q, K, V, QPOS, KPOS, OUT, LSE,  # q [Tq, Hq, D], k/v [Tk, Hkv, D], pos int64, out [Tq, Hq, D], lse [Hq, Tq]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    Tq, Tk, qk_scale_log2,
    GROUP: tl.constexpr,  # Hq // Hkv: query heads sharing one KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # mask by absolute position: key j visible to query i iff kpos[j] <= qpos[i]
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 products, not tf32
    UPCAST: tl.constexpr,  # interpreter + bf16: its tl.dot mishandles bf16, so multiply in fp32
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < Tq
    d_valid = offs_d < HEAD_DIM

    q = tl.load(  # [BLOCK_M, BLOCK_D]
        Q + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    if MASKED:
        # Padding rows get position -1 so they see nothing and never widen the block's reach.
        q_pos = tl.load(QPOS + offs_m, mask=m_valid, other=-1)
        q_pos_max = tl.max(q_pos, axis=0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for start_n in range(0, Tk, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < Tk
        live = True
        if MASKED:
            k_pos = tl.load(KPOS + offs_n, mask=n_valid, other=9223372036854775807)
            # A key block wholly in the future of every query of this block adds nothing.
            live = tl.min(k_pos, axis=0) <= q_pos_max
        if live:
            kt = tl.load(  # [BLOCK_D, BLOCK_N]: K transposed by addressing
                K + offs_n[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                mask=n_valid[None, :] & d_valid[:, None],
                other=0.0,
            )
            v = tl.load(  # [BLOCK_N, BLOCK_D]
                V + offs_n[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=n_valid[:, None] & d_valid[None, :],
                other=0.0,
            )
            if UPCAST:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)
            if MASKED:
                visible = (k_pos[None, :] <= q_pos[:, None]) & n_valid[None, :]
            else:
                visible = m_valid[:, None] & n_valid[None, :]
            m_i, l_i, acc = online_softmax_step(q, kt, v, visible, m_i, l_i, acc, qk_scale_log2, IEEE)

    out, lse = finish_softmax(m_i, l_i, acc)
    tl.store(
        OUT + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )
    tl.store(LSE + head * Tq + offs_m, lse, mask=m_valid)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_launchable(device: torch.device) -> None:
    """Triton runs on CUDA, or on CPU only when the kernels were built for the interpreter."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and INTERPRETED:
        return
    raise ValueError(
        f"Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
        f"tetris.kernels.triton_* is imported; got device {device} (interpreted={INTERPRETED})"
    )


def _check_inputs(q, k, v, q_positions, k_positions, causal: bool) -> None:
    _require(q.dim() == 3, f"q must be [Tq, Hq, D], got shape {tuple(q.shape)}")
    _require(k.dim() == 3, f"k must be [Tk, Hkv, D], got shape {tuple(k.shape)}")
    _require(k.shape == v.shape, f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    _require(q.shape[2] == k.shape[2], f"head_dim differs: q {tuple(q.shape)} vs k {tuple(k.shape)}")
    _require(q.shape[2] >= 1, f"head_dim must be positive, got q shape {tuple(q.shape)}")
    hq, hkv = q.shape[1], k.shape[1]
    _require(hkv > 0 and hq % hkv == 0, f"GQA needs Hq % Hkv == 0, got Hq={hq}, Hkv={hkv}")
    _require(q.dtype in SUPPORTED_DTYPES, f"unsupported dtype {q.dtype}; use fp16, bf16 or fp32")
    _require(k.dtype == q.dtype and v.dtype == q.dtype, f"dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    _require(q.device == k.device == v.device, f"devices differ: q {q.device}, k {k.device}, v {v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(t.stride(2) == 1 or t.shape[2] == 1, f"{name} needs a contiguous last dim, strides {t.stride()}")
    if (q_positions is None) != (k_positions is None):
        raise ValueError("pass both q_positions and k_positions, or neither")
    if q_positions is not None:
        for name, pos, n in (("q_positions", q_positions, q.shape[0]), ("k_positions", k_positions, k.shape[0])):
            _require(not pos.is_floating_point() and pos.dtype != torch.bool, f"{name} must be integer, got {pos.dtype}")
            _require(tuple(pos.shape) == (n,), f"{name} must have shape ({n},), got {tuple(pos.shape)}")
            _require(pos.device == q.device, f"{name} is on {pos.device}, q on {q.device}")
    elif causal:
        _require(q.shape[0] == k.shape[0], f"causal without positions needs Tq == Tk, got {q.shape[0]} and {k.shape[0]}")


def _launch_override() -> tuple[int, int, int, int] | None:
    """``TETRIS_TRITON_ATTENTION="BLOCK_M,BLOCK_N,WARPS,STAGES"`` (tuning and benchmarks)."""
    text = os.environ.get("TETRIS_TRITON_ATTENTION", "").strip()
    if not text:
        return None
    try:
        bm, bn, warps, stages = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"TETRIS_TRITON_ATTENTION={text!r}: expected BLOCK_M,BLOCK_N,WARPS,STAGES"
                         ) from None
    if min(bm, bn) < 16 or bm & (bm - 1) or bn & (bn - 1) or warps < 1 or stages < 1:
        raise ValueError(f"TETRIS_TRITON_ATTENTION={text!r}: blocks are powers of two >= 16")
    return bm, bn, warps, stages


# Read once at import; a benchmark may set it between timings.
LAUNCH_OVERRIDE = _launch_override()


@functools.cache
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _launch_config(tq: int, tk: int, head_dim_padded: int,
                   device: torch.device) -> tuple[int, int, dict]:
    """(BLOCK_M, BLOCK_N, launch options). 16 is tl.dot's smallest tile; 64x64 keeps a D=128
    fp16 tile pair within shared memory on every GPU. On Hopper (sm_90) 128x64 with 4 warps and
    3 stages measured 1.17-1.27x the 64x64 default on an H200 at 8k-128k tokens (causal bf16,
    D=128; docs/benchmarks.md). ``LAUNCH_OVERRIDE`` (TETRIS_TRITON_ATTENTION) wins."""
    if LAUNCH_OVERRIDE is not None:
        cap_m, cap_n, warps, stages = LAUNCH_OVERRIDE
        options = {"num_warps": warps, "num_stages": stages}
    elif head_dim_padded <= 128 and _hopper(device):
        cap_m, cap_n, options = 128, 64, {"num_warps": 4, "num_stages": 3}
    else:
        cap_m = cap_n = 64 if head_dim_padded <= 128 else 32
        options = {}
    block_m = min(cap_m, max(16, triton.next_power_of_2(tq)))
    block_n = min(cap_n, max(16, triton.next_power_of_2(tk)))
    return block_m, block_n, options


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [Tq, Hq, D] over k, v [Tk, Hkv, D] -> (out [Tq, Hq, D] q.dtype, lse [Hq, Tq] fp32).

    causal=True without positions is the standard causal mask (Tq == Tk). With q_positions and
    k_positions (int64; they imply the mask), key j is visible to query i iff
    k_positions[j] <= q_positions[i]. A
    query that sees no key gets out = 0 and lse = -inf.
    """
    _check_inputs(q, k, v, q_positions, k_positions, causal)
    check_launchable(q.device)
    tq, hq, head_dim = q.shape
    tk, hkv, _ = k.shape
    out = torch.zeros((tq, hq, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    if tq == 0 or tk == 0:
        return out, lse
    if causal and q_positions is None:
        q_positions = torch.arange(tq, dtype=torch.int64, device=q.device)
        k_positions = torch.arange(tk, dtype=torch.int64, device=q.device)
    masked = q_positions is not None
    if masked:
        q_positions = q_positions.to(torch.int64).contiguous()
        k_positions = k_positions.to(torch.int64).contiguous()
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, options = _launch_config(tq, tk, block_d, q.device)
    grid = (triton.cdiv(tq, block_m), hq)
    _attention_step_kernel[grid](
        q, k, v,
        q_positions if masked else q, k_positions if masked else k,  # unused when not masked
        out, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        tq, tk, scale * _LOG2E,
        GROUP=hq // hkv, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        MASKED=masked, IEEE=q.dtype == torch.float32,
        UPCAST=INTERPRETED and q.dtype == torch.bfloat16, **options,
    )
    return out, lse


def attention_with_lse_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch reference of `attention_with_lse` (materialises the [Hq, Tq, Tk] scores)."""
    _check_inputs(q, k, v, q_positions, k_positions, causal)
    tq, hq, head_dim = q.shape
    tk, hkv, _ = k.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Tq, Tk]
    if causal or q_positions is not None:
        if q_positions is None:
            q_positions = torch.arange(tq, device=q.device)
            k_positions = torch.arange(tk, device=q.device)
        visible = k_positions[None, :] <= q_positions[:, None]  # [Tq, Tk]
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Tq]; -inf for rows that see nothing
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.matmul(probs, vf).transpose(0, 1)  # [Tq, Hq, D]
    return out.to(q.dtype), lse
