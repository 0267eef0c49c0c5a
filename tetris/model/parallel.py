"""Tensor-parallel linear layers over a torch.distributed process group.

Megatron-style split: a ColumnParallelLinear keeps rows [r*out/tp, (r+1)*out/tp) of the full
[out, in] weight, so its output is this rank's slice of the features (for q/k/v projections
that is a contiguous range of heads); a RowParallelLinear keeps the matching columns of the
next [out, in] weight and all-reduces the partial sums. One all-reduce per column/row pair.

Without a group (``tp_group=None``) both are plain linears (tp size 1, rank 0).
Full checkpoint tensors are sharded with ``load_full``: every rank reads the same full
tensor and keeps its own slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tetris.model.packed import PackedWeight, linear

__all__ = ["tp_rank_size", "ColumnParallelLinear", "RowParallelLinear"]


def tp_rank_size(tp_group) -> tuple[int, int]:
    """(rank within the group, group size); (0, 1) without a group."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _split(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {tp}")
    return total // tp


class ColumnParallelLinear(torch.nn.Module):
    """y[:, local out] = x @ W[local out, :]^T; no communication. Bias-free (Llama)."""

    def __init__(self, in_features: int, out_features: int, *, tp_group=None, dtype=None,
                 device=None, what: str = "output features"):
        super().__init__()
        self.tp_group = tp_group
        self.rank, self.tp = tp_rank_size(tp_group)
        self.in_features = in_features
        self.out_features = out_features
        self.local_out = _split(out_features, self.tp, what)
        self.weight = torch.nn.Parameter(
            torch.empty(self.local_out, in_features, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.packed: PackedWeight | None = None  # see LlamaModel.pack_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, local_out]
        return linear(x, self.weight, self.packed)

    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        """Copy this rank's row slice of the full [out, in] weight."""
        if tuple(full.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight shape {tuple(full.shape)} != expected {(self.out_features, self.in_features)}"
            )
        rows = full[self.rank * self.local_out:(self.rank + 1) * self.local_out]
        self.weight.copy_(rows)


class RowParallelLinear(torch.nn.Module):
    """y = all_reduce(x[:, local in] @ W[:, local in]^T) over the group."""

    def __init__(self, in_features: int, out_features: int, *, tp_group=None, dtype=None,
                 device=None, what: str = "input features"):
        super().__init__()
        self.tp_group = tp_group
        self.rank, self.tp = tp_rank_size(tp_group)
        self.in_features = in_features
        self.out_features = out_features
        self.local_in = _split(in_features, self.tp, what)
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, self.local_in, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.packed: PackedWeight | None = None  # see LlamaModel.pack_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, local_in] -> [T, out]
        y = linear(x, self.weight, self.packed)
        if self.tp > 1:
            dist.all_reduce(y, group=self.tp_group)
        return y

    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        """Copy this rank's column slice of the full [out, in] weight."""
        if tuple(full.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight shape {tuple(full.shape)} != expected {(self.out_features, self.in_features)}"
            )
        cols = full[:, self.rank * self.local_in:(self.rank + 1) * self.local_in]
        self.weight.copy_(cols)
