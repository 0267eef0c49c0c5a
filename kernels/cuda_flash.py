"""Attention with LSE through torch's own CUDA flash kernel (``aten._scaled_dot_product_flash_attention``).

The kernel returns the log-sum-exp beside the output, which is all a ring step needs to be
merged (``kernels/merge.py``). It covers the ring's two common cases: a step over keys all in
the past (no mask) and the diagonal of equal positions (plain causal), in fp16/bf16 with a
head dim up to 256; a position mask goes to the Triton kernel. K/V are expanded to the query
heads (the kernel has no GQA): one extra write of K and V per call, small beside the
attention itself.

Measured on an H200 (docs/benchmarks.md, ``benchmarks/bench_kernels_gpu.py``): causal bf16
attention at 8k-128k tokens runs at 318-346 TFLOP/s here against 182-196 for our Triton
kernel, so ``kernels/dispatch.py`` prefers this path on CUDA when flash-attn is not installed.
"""

from __future__ import annotations

import torch

from tetris.kernels.attention import check_attention_inputs

__all__ = ["attention_with_lse", "cuda_flash_supports"]

_HALF = (torch.float16, torch.bfloat16)


def cuda_flash_supports(q, k, causal, q_positions, k_positions) -> bool:
    """Whether this call is one the CUDA flash kernel computes: CUDA, fp16/bf16, no position
    mask, causal only for equal query and key counts, head dim a multiple of 8 up to 256."""
    d = q.shape[-1]
    return (q.device.type == "cuda" and q.dtype in _HALF and k.dtype == q.dtype
            and q_positions is None and k_positions is None
            and (not causal or q.shape[0] == k.shape[0]) and d % 8 == 0 and d <= 256)


def attention_with_lse(q, k, v, *, causal=False, q_positions=None, k_positions=None, scale=None):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> (out [Tq, Hq, D], lse [Hq, Tq] fp32, natural log)."""
    check_attention_inputs(q, k, v, causal, q_positions, k_positions)
    if not cuda_flash_supports(q, k, causal, q_positions, k_positions):
        raise ValueError("the CUDA flash path takes CUDA fp16/bf16 without a position mask")
    tq, hq, d = q.shape
    if tq == 0 or k.shape[0] == 0:
        return (torch.zeros_like(q),
                torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device))
    group = hq // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))   # [1, H, T, D] views
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        qb, kb, vb, 0.0, causal, False, scale=scale)[:2]
    return out[0].transpose(0, 1), lse[0, :, :tq].float()
