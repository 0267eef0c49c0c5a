"""The decode instance's KV block pool as the receive manager sees it.

``ReceiveManager`` (``receive_manager.py``) allocates a request's blocks at its first
handshake (or ``reserve``) and frees them when the request fails; the request's blocks pass to
the decode engine once its KV is whole. ``BlockAllocator`` is what it needs of the pool (the
decode instance's block manager implements it); ``SimpleBlockAllocator`` is a plain free list
for tests and single-engine tools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["BlockAllocator", "SimpleBlockAllocator"]


class BlockAllocator(Protocol):
    """The decode instance's KV block pool (its block manager implements this)."""

    def allocate(self, num_blocks: int) -> list[int] | None: ...

    def free(self, blocks: Sequence[int]) -> None: ...


class SimpleBlockAllocator:
    """A free list of block ids, lowest first; enough for tests and single-engine tools."""

    def __init__(self, num_blocks: int, order: Sequence[int] | None = None) -> None:
        # ``order``: the initial free list (a permutation), e.g. to scatter a request's blocks
        self._free = list(range(num_blocks)) if order is None else list(order)
        if sorted(self._free) != list(range(num_blocks)):
            raise ValueError("order must be a permutation of range(num_blocks)")
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        if num_blocks > len(self._free):
            return None
        out, self._free = self._free[:num_blocks], self._free[num_blocks:]
        return out

    def free(self, blocks: Sequence[int]) -> None:
        self._free = sorted(set(self._free).union(blocks))
