"""Triton KV pack/unpack between paged cache blocks and contiguous transfer buffers.

Same signatures and packed layout as `tetris.kernels.kv_pack` (the torch path):

    cache of one layer   k_cache, v_cache [NB, BS, Hkv, D]; token at position p sits in slot
                         block_table[p // BS] * BS + p % BS
    packed               [L, n, 2, Hkv, D]: token-major, K then V per token, so any run of
                         consecutive tokens of a layer is one contiguous byte range

One kernel copies rows of Hkv*D elements between the flat cache [NB*BS, Hkv*D] and the packed
buffer in either direction; a launch per layer, since each layer's cache is its own tensor.
Slots come from `kv_pack.positions_to_slots`, which also checks the positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tetris.kernels.kv_pack import positions_to_slots
from tetris.kernels.triton_attention import check_launchable

_COPY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _kv_copy_kernel(
    KC, VC, SLOTS, PACKED,  # k/v cache [NB*BS, W] rows (row stride stride_slot); slots int64 [n]; packed [n, 2, W]
    n, stride_slot,
    W: tl.constexpr,  # Hkv * D
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    TO_PACKED: tl.constexpr,  # True: cache -> packed (pack); False: packed -> cache (unpack)
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (offs_t < n)[:, None] & (offs_w < W)[None, :]
    slots = tl.load(SLOTS + offs_t, mask=offs_t < n, other=0)
    cache_off = slots[:, None] * stride_slot + offs_w[None, :]
    packed_off = offs_t[:, None].to(tl.int64) * (2 * W) + offs_w[None, :]
    if TO_PACKED:
        tl.store(PACKED + packed_off, tl.load(KC + cache_off, mask=mask), mask=mask)
        tl.store(PACKED + packed_off + W, tl.load(VC + cache_off, mask=mask), mask=mask)
    else:
        tl.store(KC + cache_off, tl.load(PACKED + packed_off, mask=mask), mask=mask)
        tl.store(VC + cache_off, tl.load(PACKED + packed_off + W, mask=mask), mask=mask)


def _check_layer(k_cache: torch.Tensor, v_cache: torch.Tensor, like: torch.Tensor | None) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k/v cache must both be [NB, BS, Hkv, D] of one dtype; got {tuple(k_cache.shape)} "
            f"{k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if k_cache.dtype not in _COPY_DTYPES:
        raise ValueError(f"unsupported cache dtype {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"caches must be contiguous, strides {k_cache.stride()} and {v_cache.stride()}")
    if like is not None and (k_cache.shape[1:] != like.shape[1:] or k_cache.dtype != like.dtype
                             or k_cache.device != like.device):
        raise ValueError(
            f"layers differ: cache {tuple(k_cache.shape)} {k_cache.dtype} {k_cache.device} vs "
            f"{tuple(like.shape)} {like.dtype} {like.device}"
        )


def _copy_layer(k_cache, v_cache, slots, packed_layer, to_packed: bool) -> None:
    n = slots.numel()
    if n == 0:
        return
    width = k_cache.shape[2] * k_cache.shape[3]
    block_w = min(triton.next_power_of_2(width), 1024)
    block_t = max(1, 4096 // block_w)  # ~4K elements a program
    grid = (triton.cdiv(n, block_t), triton.cdiv(width, block_w))
    _kv_copy_kernel[grid](k_cache, v_cache, slots, packed_layer, n, width, W=width, BLOCK_T=block_t,
                          BLOCK_W=block_w, TO_PACKED=to_packed)


def _layers_and_slots(kv_caches, block_table, positions, layers):
    if not layers:
        raise ValueError("KV pack/unpack needs at least one layer")
    for layer in layers:
        if not 0 <= layer < len(kv_caches):
            raise ValueError(f"layer {layer} out of range for {len(kv_caches)} cached layers")
    k0 = kv_caches[layers[0]][0]
    for layer in layers:
        _check_layer(*kv_caches[layer], like=k0)
    check_launchable(k0.device)
    if block_table.dim() != 1 or positions.dim() != 1:
        raise ValueError(f"block_table and positions must be 1-D, got {tuple(block_table.shape)} "
                         f"and {tuple(positions.shape)}")
    slots = positions_to_slots(block_table, positions, k0.shape[1]).to(k0.device).contiguous()
    return k0, slots


def pack_kv(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_table: torch.Tensor,
            positions: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """KV of absolute `positions` [n] for `layers` -> packed [len(layers), n, 2, Hkv, D]."""
    k0, slots = _layers_and_slots(kv_caches, block_table, positions, layers)
    out = torch.empty((len(layers), slots.numel(), 2, k0.shape[2], k0.shape[3]), dtype=k0.dtype,
                      device=k0.device)
    for i, layer in enumerate(layers):
        _copy_layer(*kv_caches[layer], slots, out[i], to_packed=True)
    return out


def unpack_kv(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_table: torch.Tensor,
              positions: torch.Tensor, layers: Sequence[int], packed: torch.Tensor) -> None:
    """Write packed [len(layers), n, 2, Hkv, D] into the caches at absolute `positions` (in place)."""
    k0, slots = _layers_and_slots(kv_caches, block_table, positions, layers)
    want = (len(layers), slots.numel(), 2, k0.shape[2], k0.shape[3])
    if tuple(packed.shape) != want:
        raise ValueError(f"packed KV must be {want}, got {tuple(packed.shape)}")
    if packed.dtype != k0.dtype or packed.device != k0.device:
        raise ValueError(f"packed KV is {packed.dtype} on {packed.device}; the cache is {k0.dtype} on {k0.device}")
    packed = packed.contiguous()
    for i, layer in enumerate(layers):
        _copy_layer(*kv_caches[layer], slots, packed[i], to_packed=False)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """One layer: cache slots [n] -> out [n, 2, Hkv, D] (allocated if None), as `kv_pack.gather_kv`."""
    _check_layer(k_cache, v_cache, None)
    check_launchable(k_cache.device)
    shape = (slots.numel(), 2, k_cache.shape[2], k_cache.shape[3])
    if out is None:
        out = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    elif tuple(out.shape) != shape or out.dtype != k_cache.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {shape} {k_cache.dtype}, got {tuple(out.shape)} {out.dtype}")
    _copy_layer(k_cache, v_cache, slots.to(device=k_cache.device, dtype=torch.int64).contiguous(), out, True)
    return out


def scatter_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor) -> None:
    """One layer: packed [n, 2, Hkv, D] -> cache slots [n] (in place), as `kv_pack.scatter_kv`."""
    _check_layer(k_cache, v_cache, None)
    check_launchable(k_cache.device)
    shape = (slots.numel(), 2, k_cache.shape[2], k_cache.shape[3])
    if tuple(packed.shape) != shape or packed.dtype != k_cache.dtype:
        raise ValueError(f"packed KV must be {shape} {k_cache.dtype}, got {tuple(packed.shape)} {packed.dtype}")
    packed = packed.to(k_cache.device).contiguous()
    _copy_layer(k_cache, v_cache, slots.to(device=k_cache.device, dtype=torch.int64).contiguous(), packed, False)


def pack_kv_reference(kv_caches, block_table, positions, layers) -> torch.Tensor:
    """Torch reference: index the caches token by token through the block table."""
    page = kv_caches[layers[0]][0].shape[1]
    rows = []
    for layer in layers:
        k_cache, v_cache = kv_caches[layer]
        per_token = [torch.stack([k_cache[int(block_table[p // page]), p % page],
                                  v_cache[int(block_table[p // page]), p % page]])
                     for p in positions.tolist()]
        rows.append(torch.stack(per_token) if per_token else
                    k_cache.new_empty((0, 2, k_cache.shape[2], k_cache.shape[3])))
    return torch.stack(rows)
