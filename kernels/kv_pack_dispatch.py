"""KV pack/unpack of transfers by capability: the Triton kernels for CUDA caches, torch otherwise.

The transfer layer moves a request's KV between a paged cache and contiguous pieces
(``kv_pack.py`` describes both layouts). On CUDA the torch path is two ``index_copy_``s per
layer and piece; ``triton_kv_pack.py`` does the same in one kernel launch. This module is the
one place that chooses, with the signatures of ``kv_pack.py``:

  1. Triton: CUDA caches of a dtype it copies (fp16, bf16, fp32), both contiguous; or CPU
     caches when TRITON_INTERPRET=1 and TETRIS_KERNEL_BACKEND=triton ask for it (tests: the
     interpreter is far slower than torch, so it is never picked by itself)
  2. the torch path: everything else, meta caches (an emulated engine writes nothing) included
TETRIS_KERNEL_BACKEND narrows the choice as in ``dispatch.py``: "torch" forces torch, a
backend other than triton leaves torch (no other backend packs KV).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from functools import cache
from types import ModuleType

import torch
from tetris.kernels import kv_pack as _torch

__all__ = ["gather_kv", "kv_pack_backend", "kv_pack_backend_for", "pack_kv", "scatter_kv",
           "unpack_kv"]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@cache
def _triton() -> ModuleType | None:
    try:
        return importlib.import_module("tetris.kernels.triton_kv_pack")
    except ImportError:   # no triton installed
        return None


def kv_pack_backend(device_type: str, dtype: torch.dtype, contiguous: bool, *,
                    asked: str | None, interpret: bool, triton_importable: bool) -> str:
    """"triton" or "torch" for a cache on ``device_type`` (rules 1 and 2 above)."""
    if not triton_importable or asked not in (None, "triton"):
        return "torch"
    if dtype not in _TRITON_DTYPES or not contiguous:
        return "torch"
    if device_type == "cuda" or (device_type == "cpu" and interpret and asked == "triton"):
        return "triton"
    return "torch"


def kv_pack_backend_for(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """The backend a pack or unpack of this layer's cache uses."""
    device_type = k_cache.device.type
    if device_type not in ("cuda", "cpu"):
        return "torch"   # meta (emulated caches), anything else
    return kv_pack_backend(
        device_type, k_cache.dtype, k_cache.is_contiguous() and v_cache.is_contiguous(),
        asked=os.environ.get("TETRIS_KERNEL_BACKEND") or None,
        interpret=os.environ.get("TRITON_INTERPRET") == "1",
        triton_importable=_triton() is not None)


def _impl(k_cache: torch.Tensor, v_cache: torch.Tensor) -> ModuleType:
    return _triton() if kv_pack_backend_for(k_cache, v_cache) == "triton" else _torch


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    return _impl(k_cache, v_cache).gather_kv(k_cache, v_cache, slots, out)


def scatter_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               packed: torch.Tensor) -> None:
    _impl(k_cache, v_cache).scatter_kv(k_cache, v_cache, slots, packed)


def pack_kv(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_table: torch.Tensor,
            positions: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    k, v = kv_caches[layers[0]] if layers else (torch.empty(0), torch.empty(0))
    return _impl(k, v).pack_kv(kv_caches, block_table, positions, layers)


def unpack_kv(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_table: torch.Tensor,
              positions: torch.Tensor, layers: Sequence[int], packed: torch.Tensor) -> None:
    k, v = kv_caches[layers[0]] if layers else (torch.empty(0), torch.empty(0))
    _impl(k, v).unpack_kv(kv_caches, block_table, positions, layers, packed)
