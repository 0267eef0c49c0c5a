"""Direct writes: a prefill member writes a piece straight into the decode rank's KV blocks.

With ``transfer.direct_writes`` the receive manager registers its paged cache itself (every
layer's K and V cache tensors; VRAM on a GPU, through the agent like any buffer) instead of
only its staging buffers, and a shard's first ``Grant`` carries a ``DirectTarget``: the cache
layout and the request's block table, from which the sender computes, for each piece, one
(source offset, region, destination offset, bytes) descriptor per run of consecutive cache
slots, for K and for V. The piece leaves as one backend write of those descriptors
(``TransferAgent.write_descs``) whose notification, as before, arrives after every byte; the
receiver checks it as a staged piece and marks it received, with no scatter and no copy.

Flow control is unchanged: a grant is still a credit for one slot of a receive backend (the
slot's bytes stay unused), so backend assignment, the credit window and the fencing of slots
after an abort work as for staged pieces.

An abort must not hand blocks back while a granted write may still land in them: the receiver
keeps an aborted request's blocks (``BlockHolds``) until every credit it had outstanding has
either landed (its notice arrived: the writer's acknowledgement) or passed ``abort_grace_s``,
the same bound the staged path fences its slots with.

Layout: the sender's staging holds a piece as ``[K rows of its n tokens][V rows]`` (a row is
one token's ``Hkv x D`` elements of one layer), not the packed ``[n, 2, Hkv, D]``, so that a
run of tokens is one contiguous source range for K and one for V.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tetris.transfer.backends.base import TransferAgent
from tetris.transfer.messages import DirectTarget, RegionDesc, TokenRange

__all__ = ["BlockHolds", "DirectTarget", "piece_descriptors", "register_cache",
           "shard_positions_of", "stage_split_rows"]


def shard_positions_of(ranges: Sequence[TokenRange]) -> np.ndarray:
    """A shard's absolute positions in packed order (its ranges, one after the other)."""
    return np.concatenate([np.arange(r.start, r.end, dtype=np.int64) for r in ranges])


def stage_split_rows(kv: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
    """Copy ``kv`` ``[n, 2, Hkv, D]`` into the uint8 ``staging`` as ``[K rows][V rows]``;
    returns the staged bytes (a view of ``staging``)."""
    half = kv[:, 0].numel() * kv.element_size()
    staging[:half].view(kv.dtype).view(kv[:, 0].shape).copy_(kv[:, 0])
    staging[half:2 * half].view(kv.dtype).view(kv[:, 1].shape).copy_(kv[:, 1])
    return staging[:2 * half]


def piece_descriptors(target: DirectTarget, layer: int,
                      positions: np.ndarray) -> list[tuple[int, RegionDesc, int, int]]:
    """(source offset, region, destination offset, bytes) of one piece: ``positions`` (the
    piece's absolute positions, in order) of ``layer``, staged as ``stage_split_rows`` lays it out.
    One descriptor per run of consecutive cache slots, first every K run, then every V run."""
    bs, row, n = target.block_size, target.row_bytes, positions.size
    if n == 0:
        return []
    block_index = positions // bs
    if int(block_index.max()) >= len(target.blocks) or int(positions.min()) < 0:
        raise ValueError(f"positions up to {int(positions.max())} need more than the "
                         f"{len(target.blocks)} blocks granted")
    slots = np.asarray(target.blocks, dtype=np.int64)[block_index] * bs + positions % bs
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    out = []
    for half, region in ((0, target.k_regions[layer]), (1, target.v_regions[layer])):
        for a, b in zip(starts.tolist(), ends.tolist()):
            out.append(((half * n + a) * row, region, int(slots[a]) * row, (b - a) * row))
    return out


def register_cache(agent: TransferAgent, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[tuple[RegionDesc, ...], tuple[RegionDesc, ...]]:
    """Register every layer's K and V cache with the receiver's agent: (K regions, V regions)."""
    if not agent.capabilities.scattered_writes:
        raise ValueError(f"transfer.direct_writes needs a backend with scattered writes; "
                         f"{agent.backend!r} writes one range at a time")
    return (tuple(agent.register(k) for k, _ in kv_caches),
            tuple(agent.register(v) for _, v in kv_caches))


class BlockHolds:
    """Blocks of aborted requests kept until no granted write can land in them any more."""

    def __init__(self) -> None:
        # [blocks, (backend, slot) credits still outstanding, deadline]
        self._held: list[tuple[list[int], set[tuple[int, int]], float]] = []

    def hold(self, blocks: list[int], credits: set[tuple[int, int]], deadline: float) -> None:
        self._held.append((list(blocks), set(credits), deadline))

    def landed(self, backend_id: int, slot: int) -> None:
        """A straggling piece's notice arrived: its bytes are in; that writer is done."""
        for _, credits, _ in self._held:
            credits.discard((backend_id, slot))

    def release(self, now: float) -> list[list[int]]:
        """The held block lists that are safe now (every writer acknowledged, or timed out)."""
        free = [h for h in self._held if not h[1] or now >= h[2]]
        self._held = [h for h in self._held if h[1] and now < h[2]]
        return [h[0] for h in free]

    @property
    def blocks(self) -> list[int]:
        return sorted(b for blocks, _, _ in self._held for b in blocks)

    def __bool__(self) -> bool:
        return bool(self._held)
