"""Triton merge of two partial attention results by log-sum-exp (SPEC §6, ring attention).

For partials over disjoint key sets A and B (the online-softmax identity):

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A side with lse = -inf saw no key and weighs 0; both -inf gives out = 0, lse = -inf.
Same signature as `tetris.kernels.merge.merge_attention` (the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tetris.kernels.triton_attention import SUPPORTED_DTYPES, check_launchable


@triton.jit
def _merge_kernel(
    OA, LA, OB, LB, OUT, LSE,  # out_* [T, H, D], lse_* [H, T] fp32, OUT [T, H, D], LSE [H, T] fp32
    stride_oa_t, stride_oa_h, stride_ob_t, stride_ob_h, stride_o_t, stride_o_h,
    stride_la_h, stride_la_t, stride_lb_h, stride_lb_t,
    T,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_valid = offs_t < T
    tile_mask = t_valid[:, None] & (offs_d < HEAD_DIM)[None, :]

    lse_a = tl.load(LA + head * stride_la_h + offs_t * stride_la_t, mask=t_valid, other=float("-inf"))
    lse_b = tl.load(LB + head * stride_lb_h + offs_t * stride_lb_t, mask=t_valid, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    # Both sides empty: shift by 0 so exp(-inf - 0) = 0 rather than exp(nan).
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_shift)
    w_b = tl.exp(lse_b - m_shift)
    total = w_a + w_b
    seen = total > 0.0
    lse = tl.where(seen, m_shift + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    w_a = w_a / tl.where(seen, total, 1.0)
    w_b = w_b / tl.where(seen, total, 1.0)

    o_a = tl.load(OA + offs_t[:, None] * stride_oa_t + head * stride_oa_h + offs_d[None, :], mask=tile_mask, other=0.0)
    o_b = tl.load(OB + offs_t[:, None] * stride_ob_t + head * stride_ob_h + offs_d[None, :], mask=tile_mask, other=0.0)
    out = o_a.to(tl.float32) * w_a[:, None] + o_b.to(tl.float32) * w_b[:, None]
    tl.store(OUT + offs_t[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=tile_mask)
    tl.store(LSE + head * T + offs_t, lse, mask=t_valid)


def _check(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.dim() != 3 or out_a.shape != out_b.shape:
        raise ValueError(
            f"merge needs two outputs of one [T, H, D] shape; got {tuple(out_a.shape)} and {tuple(out_b.shape)}"
        )
    t, h, _ = out_a.shape
    if tuple(lse_a.shape) != (h, t) or tuple(lse_b.shape) != (h, t):
        raise ValueError(f"lse must be [H, T] = [{h}, {t}]; got {tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
    for name, o in (("out_a", out_a), ("out_b", out_b)):
        if o.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has unsupported dtype {o.dtype}; use fp16, bf16 or fp32")
        if o.stride(2) != 1 and o.shape[2] > 1:
            raise ValueError(f"{name} needs a contiguous last dim, strides {o.stride()}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {lse.dtype}")
    devices = {str(x.device) for x in (out_a, lse_a, out_b, lse_b)}
    if len(devices) != 1:
        raise ValueError(f"merge inputs lie on several devices: {sorted(devices)}")


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partials -> (out [T, H, D] in out_a.dtype, lse [H, T] float32)."""
    _check(out_a, lse_a, out_b, lse_b)
    check_launchable(out_a.device)
    t, h, head_dim = out_a.shape
    out = torch.empty((t, h, head_dim), dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty((h, t), dtype=torch.float32, device=out_a.device)
    if t == 0 or h == 0 or head_dim == 0:
        return out, lse
    block_d = triton.next_power_of_2(head_dim)
    # Keep a tile near 4K elements: wide enough to stream, small enough for registers.
    block_t = max(1, min(triton.next_power_of_2(t), 4096 // block_d))
    grid = (triton.cdiv(t, block_t), h)
    _merge_kernel[grid](
        out_a, lse_a, out_b, lse_b, out, lse,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        t, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=block_t,
    )
    return out, lse


def merge_attention_reference(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch reference of `merge_attention`."""
    _check(out_a, lse_a, out_b, lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    shift = torch.where(torch.isneginf(lse), 0.0, lse)
    w_a = torch.exp(lse_a - shift).transpose(0, 1)[..., None]  # [T, H, 1]
    w_b = torch.exp(lse_b - shift).transpose(0, 1)[..., None]
    return (out_a.float() * w_a + out_b.float() * w_b).to(out_a.dtype), lse
