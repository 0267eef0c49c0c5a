"""Finished requests' KV kept on a decode engine for a later request's prefix (the decode side
of prefix caching, docs/prefix_cache.md).

A conversation's next turn resends the whole conversation; the decode instance that ran the
last turn still has its KV if it kept it. ``want(run)`` before the run finishes makes the
engine keep the run's blocks when it finishes normally (stop or length; an aborted run and a
preempted one free them as before). A later request whose first ``n`` positions the run holds
reads them from the run's blocks, so the prefix is not streamed again:

1. ``shared_blocks(run, n)``: the run's blocks that ``[0, n)`` fills completely;
2. the engine reserves the request with those at the head of its table (one more reference
   each, ``BlockManager.allocate``): only the blocks it does not share come from the free list;
3. ``copy_boundary(run, table, n)``: the positions of ``[0, n)`` in a block only partly covered
   (the boundary block) are copied into the request's own block (copy-on-write: the request
   writes its next positions there, the run's block stays as the run left it); every block
   from there on must be the request's alone (asserted), so no write reaches a shared block.

``drop(run)`` lets go of the kept blocks (a block a reader still holds stays until it
finishes); ``make_room`` drops the earliest kept runs when a new request would not fit otherwise,
and so does the batcher when a running request would be preempted or a waiting one left
waiting for room (``BlockManager.make_room``); whoever recorded them finds them gone: sharing a
run no longer kept is refused, ``covers``.
Every TP rank applies the same reservations in the same order to its own engine, so the
sharing is the same on each.
"""

from __future__ import annotations

import torch

from tetris.engine.request import FinishReason

__all__ = ["KeptKV"]


class KeptKV:
    """The kept runs of one engine: run -> (block table, the tokens whose KV it holds)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._wanted: set[str] = set()
        self.runs: dict[str, tuple[list[int], list[int]]] = {}
        engine.blocks.keeper = self._keep_on_free
        engine.blocks.reclaim = self._reclaim

    def want(self, run_id: str) -> None:
        self._wanted.add(run_id)

    def tokens(self, run_id: str) -> int:
        """KV positions kept for ``run_id`` (0 if none)."""
        kept = self.runs.get(run_id)
        return 0 if kept is None else len(kept[1])

    def covers(self, run_id: str, token_ids, upto: int) -> bool:
        """Whether the kept run holds KV of exactly ``token_ids[:upto]`` (a prefix read for
        other tokens would be silently wrong: checked here, not trusted to the caller)."""
        kept = self.runs.get(run_id)
        return kept is not None and len(kept[1]) >= upto and \
            kept[1][:upto] == [int(t) for t in token_ids[:upto]]

    def _keep_on_free(self, seq) -> bool:
        """The block manager frees ``seq``: True keeps its blocks (it finished normally and
        was wanted). A preempted run stays wanted (it will finish later)."""
        rid = seq.request_id
        if rid not in self._wanted or not seq.is_finished:
            return False
        self._wanted.discard(rid)
        if seq.finish_reason is FinishReason.ABORT:
            return False
        # The last sampled token's KV was never computed: positions [0, num_computed) hold KV.
        self.runs[rid] = (list(seq.block_table), list(seq.tokens)[:seq.num_computed])
        return True

    def shared_blocks(self, run_id: str, upto: int) -> list[int]:
        """The kept run's blocks that positions ``[0, upto)`` fill completely (a request whose
        prefix they hold shares them); ``ValueError`` if the run is not kept or holds fewer
        positions."""
        kept = self.runs.get(run_id)
        if kept is None or len(kept[1]) < upto:
            raise ValueError(f"no kept KV of {run_id!r} covering [0, {upto}) on this engine")
        return kept[0][:upto // self.engine.blocks.block_size]

    def copy_boundary(self, run_id: str, table: list[int], upto: int) -> None:
        """Complete a request reserved sharing ``shared_blocks(run_id, upto)``: the positions
        of ``[0, upto)`` past its shared blocks (those of the boundary block) are copied from
        the run's block into the request's own (every layer; a device-local copy)."""
        shared = self.shared_blocks(run_id, upto)
        if table[:len(shared)] != shared:
            raise ValueError(f"the table {table[:len(shared)]} does not share {shared}")
        blocks = self.engine.blocks
        blocks.assert_exclusive(table[len(shared):])   # everything written from here on
        bs = blocks.block_size
        start = len(shared) * bs
        cache = self.engine.cache
        if start == upto or not hasattr(cache, "k") or cache.k[0].is_meta:
            return   # on a block boundary: nothing to copy; EMULATION: no KV stored
        src = _slots(self.runs[run_id][0], start, upto, bs, cache.k[0].device)
        dst = _slots(table, start, upto, bs, cache.k[0].device)
        for layer in range(len(cache.k)):
            for t in (cache.k[layer], cache.v[layer]):
                flat = t.view(-1, *t.shape[2:])
                flat.index_copy_(0, dst, flat.index_select(0, src))

    def make_room(self, tokens: int, spare: str = "", shared: int = 0) -> list[str]:
        """Free kept runs, the earliest kept first (but ``spare``), until a reservation of
        ``tokens`` sharing ``shared`` blocks fits; the runs freed. Kept KV never makes the
        engine refuse a request."""
        dropped = []
        for run in list(self.runs):
            if self.engine.can_reserve(tokens, shared):
                break
            if run != spare:
                self.drop(run)
                dropped.append(run)
        return dropped

    def _reclaim(self, blocks: int) -> None:
        """The engine's own requests need ``blocks`` free blocks (a preempted one coming back,
        one growing): drop kept runs, the earliest first, until they are. A preempted reader
        lets go of only its unshared blocks, so it may need a kept run's to come back."""
        for run in list(self.runs):
            if self.engine.blocks.num_free_blocks >= blocks:
                return
            self.drop(run)

    def drop(self, run_id: str) -> bool:
        """Let go of the run's kept blocks (and forget a wish to keep it); False if none. A
        block shared with a request still running returns to the free list when it ends."""
        self._wanted.discard(run_id)
        kept = self.runs.pop(run_id, None)
        if kept is None:
            return False
        self.engine.blocks.free_owned(run_id, kept[0])
        return True


def _slots(table: list[int], start: int, end: int, block_size: int, device) -> torch.Tensor:
    pos = torch.arange(start, end, device=device)
    blocks = torch.tensor(table, dtype=torch.int64, device=device)
    return blocks[pos // block_size] * block_size + pos % block_size
