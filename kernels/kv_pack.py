"""Pack a request's KV out of a paged cache into one contiguous buffer, and unpack it back.

Paged cache of one layer: ``k_cache``, ``v_cache`` of shape ``[NB, BS, Hkv, D]``; a request's
block table (int32 ``[MAXB]``) maps token position ``p`` to slot
``block_table[p // BS] * BS + p % BS``.

Packed layout: ``[n, 2, Hkv, D]`` per layer (token-major, K then V for each token), so that
any run of consecutive tokens is one contiguous byte range: the transfer layer cuts a layer
into pieces by token offset without another copy. For several layers: ``[L, n, 2, Hkv, D]``.

Torch path; a Triton variant would keep the same signatures.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "positions_to_slots",
    "gather_kv",
    "scatter_kv",
    "pack_kv",
    "unpack_kv",
    "packed_bytes_per_token",
]


def packed_bytes_per_token(kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token takes in the packed layout of one layer (K and V)."""
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def positions_to_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Absolute token positions ``[n]`` -> cache slots ``[n]`` (int64) through ``block_table``."""
    positions = positions.to(torch.int64)
    if positions.numel() == 0:
        return positions
    if int(positions.min()) < 0:
        raise ValueError("token positions must be non-negative")
    block_index = positions // block_size
    if int(block_index.max()) >= block_table.numel():
        raise ValueError(
            f"position {int(positions.max())} needs block {int(block_index.max())}, "
            f"but the block table has {block_table.numel()} blocks"
        )
    blocks = block_table.to(torch.int64)[block_index]
    return blocks * block_size + positions % block_size


def _flat(cache: torch.Tensor) -> torch.Tensor:
    # [NB, BS, Hkv, D] -> [NB*BS, Hkv, D] (a view: caches are contiguous)
    return cache.view(-1, cache.shape[-2], cache.shape[-1])


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Read slots ``[n]`` of one layer's cache into ``out`` ``[n, 2, Hkv, D]`` (allocated if None)."""
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    n = slots.numel()
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    if out is None:
        out = torch.empty((n, 2, hkv, d), dtype=k_cache.dtype, device=k_cache.device)
    elif out.shape != (n, 2, hkv, d) or out.dtype != k_cache.dtype:
        raise ValueError(f"out must be {(n, 2, hkv, d)} {k_cache.dtype}, got {tuple(out.shape)} {out.dtype}")
    slots = slots.to(device=k_cache.device, dtype=torch.int64)
    out[:, 0] = _flat(k_cache).index_select(0, slots)
    out[:, 1] = _flat(v_cache).index_select(0, slots)
    return out


def scatter_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor) -> None:
    """Write ``packed`` ``[n, 2, Hkv, D]`` into slots ``[n]`` of one layer's cache."""
    n = slots.numel()
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    if packed.shape != (n, 2, hkv, d):
        raise ValueError(f"packed KV must be {(n, 2, hkv, d)}, got {tuple(packed.shape)}")
    if packed.dtype != k_cache.dtype:
        raise ValueError(f"packed KV dtype {packed.dtype} differs from the cache dtype {k_cache.dtype}")
    if k_cache.is_meta and v_cache.is_meta:
        # An emulated cache (actors/decode/emulated.py) holds no memory: nothing to write, and
        # index_copy_ on meta tensors runs a Python decomposition (~50 us a piece, per rank).
        return
    slots = slots.to(device=k_cache.device, dtype=torch.int64)
    _flat(k_cache).index_copy_(0, slots, packed[:, 0].to(k_cache.device))
    _flat(v_cache).index_copy_(0, slots, packed[:, 1].to(k_cache.device))


def pack_kv(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_table: torch.Tensor,
            positions: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """KV of ``positions`` (absolute, ``[n]``) for ``layers`` -> ``[len(layers), n, 2, Hkv, D]``."""
    if not layers:
        raise ValueError("pack_kv needs at least one layer")
    k0 = kv_caches[layers[0]][0]
    slots = positions_to_slots(block_table, positions, k0.shape[1])
    out = torch.empty((len(layers), slots.numel(), 2, k0.shape[-2], k0.shape[-1]), dtype=k0.dtype,
                      device=k0.device)
    for i, layer in enumerate(layers):
        k_cache, v_cache = kv_caches[layer]
        gather_kv(k_cache, v_cache, slots, out=out[i])
    return out


def unpack_kv(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_table: torch.Tensor,
              positions: torch.Tensor, layers: Sequence[int], packed: torch.Tensor) -> None:
    """Place ``packed`` ``[len(layers), n, 2, Hkv, D]`` at absolute ``positions`` of ``layers``."""
    if packed.shape[0] != len(layers):
        raise ValueError(f"packed KV holds {packed.shape[0]} layers, {len(layers)} given")
    k0 = kv_caches[layers[0]][0]
    slots = positions_to_slots(block_table, positions, k0.shape[1])
    for i, layer in enumerate(layers):
        k_cache, v_cache = kv_caches[layer]
        scatter_kv(k_cache, v_cache, slots, packed[i])
