"""Kernel choice by capability: device type, dtype, mask kind and what can be imported.

Every implementation has the signature of the torch path in ``attention.py``, ``merge.py``
and ``paged_decode.py``. Accelerated variants are optional modules of this package that
define those functions under the same names (a missing module just means "not available"):

    triton      tetris.kernels.triton_attention (attention_with_lse),
                tetris.kernels.triton_merge (merge_attention),
                tetris.kernels.triton_paged_decode (paged_decode_attention)
    flash_attn  tetris.kernels.flash_attn_backend (any of the three), CUDA fp16/bf16
    cuda_flash  tetris.kernels.cuda_flash (attention_with_lse): torch's CUDA flash kernel

Order for each call:
  1. flash-attn: CUDA, half precision (position masks become a few causal pieces there)
  2. torch's CUDA flash kernel: CUDA, half precision, no position mask (a ring step over past
     keys, or a diagonal of equal positions); measured 1.7x the Triton kernel on an H200
  3. Triton: CUDA; or CPU when TRITON_INTERPRET=1 and TETRIS_KERNEL_BACKEND=triton ask for it
     (the interpreter is far slower than torch, so it is never picked by itself)
  4. the CPU flash kernel: CPU float tensors (position masks as additive masks)
  5. the torch path
TETRIS_KERNEL_BACKEND (flash_attn, cuda_flash, triton, cpu_flash, torch) narrows the choice;
"torch" forces the torch path.
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from types import ModuleType

import torch

from tetris.kernels import attention as _attention
from tetris.kernels import merge as _merge
from tetris.kernels import paged_decode as _paged

__all__ = [
    "attention_with_lse",
    "merge_attention",
    "paged_decode_attention",
    "available_backends",
    "attention_backend_for",
]

_FUNCTIONS = ("attention_with_lse", "merge_attention", "paged_decode_attention")
_MODULES = {
    "flash_attn": {fn: "tetris.kernels.flash_attn_backend" for fn in _FUNCTIONS},
    "cuda_flash": {"attention_with_lse": "tetris.kernels.cuda_flash"},
    "triton": {
        "attention_with_lse": "tetris.kernels.triton_attention",
        "merge_attention": "tetris.kernels.triton_merge",
        "paged_decode_attention": "tetris.kernels.triton_paged_decode",
    },
}


@cache
def _module(path: str) -> ModuleType | None:
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


@cache
def _impl(backend: str, fn: str):
    if fn not in _MODULES[backend]:
        return None
    mod = _module(_MODULES[backend][fn])
    return getattr(mod, fn, None) if mod is not None else None


def available_backends() -> list[str]:
    """Names of the usable backends, fastest first; "torch" is always there."""
    found = [b for b in ("flash_attn", "triton") if any(_impl(b, fn) for fn in _FUNCTIONS)]
    if torch.cuda.is_available() and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention"):
        found.insert(1 if "flash_attn" in found else 0, "cuda_flash")
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        found.append("cpu_flash")
    return found + ["torch"]


def _asked() -> str | None:
    return os.environ.get("TETRIS_KERNEL_BACKEND") or None


def _triton_ok(device_type: str) -> bool:
    if device_type == "cuda":
        return _asked() in (None, "triton")
    return os.environ.get("TRITON_INTERPRET") == "1" and _asked() == "triton"


def _cuda_flash_ok(q, k, causal, q_positions, k_positions) -> bool:
    from tetris.kernels.cuda_flash import cuda_flash_supports

    return cuda_flash_supports(q, k, causal, q_positions, k_positions)


def attention_backend_for(q, k, *, causal=False, q_positions=None, k_positions=None) -> str:
    """The backend ``attention_with_lse`` would use for these inputs."""
    asked = _asked()
    if asked == "torch":
        return "torch"
    dev = q.device.type
    if (dev == "cuda" and asked in (None, "flash_attn")
            and q.dtype in (torch.float16, torch.bfloat16)
            and _impl("flash_attn", "attention_with_lse") is not None):
        return "flash_attn"
    if dev == "cuda" and asked in (None, "cuda_flash") and _cuda_flash_ok(q, k, causal,
                                                                           q_positions, k_positions):
        return "cuda_flash"
    if _triton_ok(dev) and _impl("triton", "attention_with_lse") is not None:
        return "triton"
    if (asked in (None, "cpu_flash") and "cpu_flash" in available_backends()
            and _attention.cpu_flash_supports(q, k, causal, q_positions, k_positions)):
        return "cpu_flash"
    return "torch"


def attention_with_lse(q, k, v, *, causal=False, q_positions=None, k_positions=None, scale=None):
    # Positions are bookkeeping and often live on the host (ring and layout code index with
    # them there); every kernel reads them beside q.
    if q_positions is not None and q_positions.device != q.device:
        q_positions = q_positions.to(q.device, non_blocking=True)
    if k_positions is not None and k_positions.device != q.device:
        k_positions = k_positions.to(q.device, non_blocking=True)
    backend = attention_backend_for(q, k, causal=causal, q_positions=q_positions,
                                    k_positions=k_positions)
    if backend == "cpu_flash":
        fn = _attention.attention_with_lse_cpu_flash
    elif backend == "torch":
        fn = _attention.attention_with_lse
    else:
        fn = _impl(backend, "attention_with_lse")
    return fn(q, k, v, causal=causal, q_positions=q_positions, k_positions=k_positions,
              scale=scale)


def merge_attention(out_a, lse_a, out_b, lse_b):
    if _triton_ok(out_a.device.type):
        fn = _impl("triton", "merge_attention")
        if fn is not None:
            return fn(out_a, lse_a, out_b, lse_b)
    return _merge.merge_attention(out_a, lse_a, out_b, lse_b)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    dev = q.device.type
    for backend in ("flash_attn", "triton"):
        if backend == "flash_attn" and (dev != "cuda" or _asked() not in (None, "flash_attn")):
            continue
        if backend == "triton" and not _triton_ok(dev):
            continue
        fn = _impl(backend, "paged_decode_attention")
        if fn is not None:
            return fn(q, k_cache, v_cache, block_tables, context_lens, scale)
    return _paged.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
