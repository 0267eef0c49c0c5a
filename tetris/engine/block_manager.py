"""KV block accounting: which cache blocks each sequence owns.

Checking and acting are separate calls (``can_allocate``/``allocate``, ``can_append``/
``append_slot``) so that the batcher can decide without side effects and then commit. Acting
without room raises instead of silently over-committing. Blocks come from a FIFO free list,
so the same request stream always gets the same blocks (reproducible slot mappings).

A block may be held by several tables at once (prefix caching's decode side, engine/kept_kv.py):
``allocate(seq, shared)`` puts blocks another holder already holds at the head of ``seq``'s
table; each block counts its holders (its reference count) and returns to the free list when
the last one lets go, so a shared block is counted once in ``num_free_blocks``. A shared block
is read-only: a new request shares only blocks its prefix fills completely, so every position
it writes lies in a block of its own (``assert_exclusive``; ``append_slot`` checks it).
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
        # block -> its holders (request ids or owners), one entry per table holding it: the
        # block's reference count is the list's length
        self._holders: dict[int, list[str]] = {}
        # Prefix caching's decode side (engine/kept_kv.py): True keeps a freed sequence's blocks;
        # ``reclaim(n)`` lets kept runs go until ``n`` blocks are free (they never refuse a request)
        self.keeper = None
        self.reclaim = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int, shared: int = 0) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits in the free blocks now, when its
        first ``shared`` blocks are shared with another holder (they need no free block)."""
        return self.blocks_needed(num_tokens) - shared <= len(self._free)

    def allocate(self, seq: Sequence, shared=()) -> None:
        """Give ``seq`` (holding no blocks) blocks for all of its current tokens: ``shared``
        (blocks held already, e.g. a kept run's: engine/kept_kv.py) first, each one more
        reference, then free blocks for the rest."""
        if seq.block_table:
            raise ValueError(f"{seq.request_id}: already holds {len(seq.block_table)} blocks")
        shared = [int(b) for b in shared]
        need = self.blocks_needed(_held_tokens(seq))
        if len(shared) > need or len(set(shared)) != len(shared) or \
                any(b not in self._holders for b in shared):
            raise ValueError(f"{seq.request_id}: cannot share {shared} (held blocks, distinct, "
                             f"at most the {need} its tokens fill)")
        if need - len(shared) > len(self._free):
            beside = f" beside {len(shared)} shared" if shared else ""
            raise OutOfBlocksError(f"{seq.request_id}: needs {need - len(shared)} blocks"
                                   f"{beside}, {len(self._free)} free")
        for block in shared:
            self._holders[block].append(seq.request_id)
        seq.block_table = shared + [self._take(seq.request_id)
                                    for _ in range(need - len(shared))]

    def make_room(self, blocks: int) -> bool:
        """Whether ``blocks`` blocks are free, once kept runs let go of theirs if needed (the
        batcher asks before it preempts or leaves a request waiting)."""
        if len(self._free) < blocks and self.reclaim is not None:
            self.reclaim(blocks)
        return len(self._free) >= blocks

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``seq``'s newest token can get a slot (a new block only at a boundary)."""
        return self._needs_block(seq) <= len(self._free)

    def append_slot(self, seq: Sequence) -> None:
        """Give ``seq``'s newest token (appended after its last step) a slot; the step writes
        that token's KV there, so its block must be ``seq``'s alone."""
        if self._needs_block(seq):
            if not self._free:
                raise OutOfBlocksError(f"{seq.request_id}: no free block to grow into")
            seq.block_table.append(self._take(seq.request_id))
        self.assert_exclusive(seq.block_table[(_held_tokens(seq) - 1) // self.block_size:])

    def free(self, seq: Sequence) -> None:
        """Let go of every block of ``seq`` (a shared one stays with its other holders); a
        sequence holding none is a no-op."""
        if self.keeper is not None and seq.block_table and self.keeper(seq):
            seq.block_table = []   # still held by it: kept for a later request's prefix
            return
        self.free_owned(seq.request_id, seq.block_table)
        seq.block_table = []

    def free_owned(self, owner: str, blocks) -> None:
        """Let go of ``blocks`` held under ``owner`` (engine/kept_kv.py); a block returns to
        the free list when its last holder lets go."""
        for block in blocks:
            holders = self._holders.get(block)
            if holders is None or owner not in holders:
                raise RuntimeError(f"block {block} freed by {owner} but not held by it")
            holders.remove(owner)
            if not holders:
                del self._holders[block]
                self._free.append(block)

    # -- sharing: reference counts ---------------------------------------------------------
    def refcount(self, block: int) -> int:
        """How many tables hold ``block`` (0: free)."""
        return len(self._holders.get(block, ()))

    def assert_exclusive(self, blocks) -> None:
        """``blocks`` are about to be written: none may be shared (another holder reads it)."""
        shared = [b for b in blocks if len(self._holders.get(b, ())) != 1]
        if shared:
            raise AssertionError(f"a write into blocks {shared} held by "
                                 f"{[self._holders.get(b, []) for b in shared]}")

    def check(self, tables) -> None:
        """The accounting invariant, for tests: ``tables`` (holder -> block table, every table
        holding blocks) give each held block exactly its reference count, and every block is
        either held or free, once."""
        counts: dict[int, list[str]] = {}
        for holder, table in tables.items():
            for block in table:
                counts.setdefault(block, []).append(holder)
        held = {b: sorted(h) for b, h in self._holders.items()}
        if held != {b: sorted(h) for b, h in counts.items()}:
            raise AssertionError(f"holders {held} but tables {counts}")
        free = list(self._free)
        if len(set(free)) != len(free) or set(free) & set(held) or \
                len(free) + len(held) != self.num_blocks:
            raise AssertionError(f"{len(free)} free ({len(set(free))} distinct) and "
                                 f"{len(held)} held of {self.num_blocks} blocks")

    def withhold(self, owner: str, blocks) -> list[int]:
        """Take those of ``blocks`` that are free out of circulation under ``owner`` until
        ``free_owned`` (a direct KV write may still land in them: transfer/direct.py)."""
        wanted = set(blocks) & set(self._free)
        if wanted:
            self._free = deque(b for b in self._free if b not in wanted)
            for block in wanted:
                self._holders[block] = [owner]
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
        self._holders[block] = [owner]
        return block


def _held_tokens(seq) -> int:
    """Tokens whose KV the table holds: a sharded request's master holds its positions from
    ``kv_start`` on (engine/elastic_rows.py); a ``KVShard`` counts its own range."""
    return seq.num_tokens - getattr(seq, "kv_start", 0)
