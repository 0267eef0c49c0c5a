"""KV block accounting: which cache blocks each sequence owns.

Checking and acting are separate calls (``can_allocate``/``allocate``, ``can_append``/
``append_slot``) so that the batcher can decide without side effects and then commit. Acting
without room raises instead of silently over-committing. Blocks come from a FIFO free list,
so the same request stream always gets the same blocks (reproducible slot mappings).
"""

from __future__ import annotations

from collections import deque

from tetris.engine.request import Sequence

__all__ = ["BlockManager", "OutOfBlocksError"]


class OutOfBlocksError(RuntimeError):
    """An allocation was attempted without checking that the blocks exist."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}
        # Prefix caching's decode side (engine/kept_kv.py): True keeps a freed sequence's blocks.
        self.keeper = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits in the free blocks now."""
        return self.blocks_needed(num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` (holding no blocks) blocks for all of its current tokens."""
        if seq.block_table:
            raise ValueError(f"{seq.request_id}: already holds {len(seq.block_table)} blocks")
        need = self.blocks_needed(_held_tokens(seq))
        if need > len(self._free):
            raise OutOfBlocksError(
                f"{seq.request_id}: needs {need} blocks, {len(self._free)} free"
            )
        seq.block_table = [self._take(seq.request_id) for _ in range(need)]

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``seq``'s newest token can get a slot (a new block only at a boundary)."""
        return self._needs_block(seq) <= len(self._free)

    def append_slot(self, seq: Sequence) -> None:
        """Give ``seq``'s newest token (appended after its last step) a slot."""
        if self._needs_block(seq):
            if not self._free:
                raise OutOfBlocksError(f"{seq.request_id}: no free block to grow into")
            seq.block_table.append(self._take(seq.request_id))

    def free(self, seq: Sequence) -> None:
        """Return every block of ``seq``; a sequence holding none is a no-op."""
        if self.keeper is not None and seq.block_table and self.keeper(seq):
            seq.block_table = []   # still owned by it: kept for a later request's prefix
            return
        for block in seq.block_table:
            if self._owner.pop(block, None) != seq.request_id:
                raise RuntimeError(f"block {block} freed by {seq.request_id} but not owned by it")
            self._free.append(block)
        seq.block_table = []

    def free_owned(self, owner: str, blocks) -> None:
        """Return ``blocks`` kept under ``owner`` (engine/kept_kv.py)."""
        for block in blocks:
            if self._owner.pop(block, None) != owner:
                raise RuntimeError(f"block {block} freed by {owner} but not owned by it")
            self._free.append(block)

    def withhold(self, owner: str, blocks) -> list[int]:
        """Take those of ``blocks`` that are free out of circulation under ``owner`` until
        ``free_owned`` (a direct KV write may still land in them: transfer/direct.py)."""
        wanted = set(blocks) & set(self._free)
        if wanted:
            self._free = deque(b for b in self._free if b not in wanted)
            for block in wanted:
                self._owner[block] = owner
        return sorted(wanted)

    def reserve(self, owner: str) -> int:
        """Take one block out of circulation for good (e.g. the CUDA graphs' scratch slots)."""
        if not self._free:
            raise OutOfBlocksError(f"{owner}: no free block to reserve")
        return self._take(owner)

    def _needs_block(self, seq: Sequence) -> int:
        return int(_held_tokens(seq) > len(seq.block_table) * self.block_size)

    def _take(self, owner: str) -> int:
        block = self._free.popleft()
        self._owner[block] = owner
        return block


def _held_tokens(seq) -> int:
    """Tokens whose KV the table holds: a sharded request's master holds its positions from
    ``kv_start`` on (engine/elastic_rows.py); a ``KVShard`` counts its own range."""
    return seq.num_tokens - getattr(seq, "kv_start", 0)
