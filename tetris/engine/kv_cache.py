"""The paged KV cache tensors of one instance (one TP rank).

Per layer ``k`` and ``v`` of shape [num_blocks, block_size, Hkv_local, D]; token ``t`` of a
sequence lives at slot ``block_table[t // block_size] * block_size + t % block_size``. Both
layers' tensors are views into one allocation so that a cache is a single buffer to register
with a transfer backend.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "kv_bytes_per_block"]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("KV cache dimensions must be positive")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        # [L, 2, NB, BS, Hkv, D]: index [i, 0] is layer i's keys, [i, 1] its values.
        self.buffer = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        self.k = [self.buffer[i, 0] for i in range(num_layers)]
        self.v = [self.buffer[i, 1] for i in range(num_layers)]

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int) -> KVCache:
        """A cache shaped for ``model`` (a ``LlamaModel``; uses its local KV head count)."""
        weight = next(model.parameters())
        return cls(model.num_layers, num_blocks, block_size, model.local_num_kv_heads,
                   model.head_dim, dtype=weight.dtype, device=weight.device)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (int64 [T]) of ``layer``: two [T, Hkv, D] tensors."""
        k = self.k[layer].view(-1, *self.k[layer].shape[2:])
        v = self.v[layer].view(-1, *self.v[layer].shape[2:])
        return k.index_select(0, slots), v.index_select(0, slots)
