"""Finished requests' KV kept on a decode engine for a later request's prefix (the decode side
of prefix caching, docs/prefix_cache.md).

A conversation's next turn resends the whole conversation; the decode instance that ran the
last turn still has its KV if it kept it. ``want(run)`` before the run finishes makes the
engine keep the run's blocks when it finishes normally (stop or length; an aborted run and a
preempted one free them as before). ``copy_prefix(run, table, n)`` writes the kept KV of
positions ``[0, n)`` into another request's blocks (every layer; a device-local copy, so the
prefix need not be streamed again), and ``drop(run)`` frees the kept blocks; ``make_room``
frees the earliest kept runs when a new request would not fit otherwise (whoever recorded
them finds them gone: a copy from a run no longer kept is refused, ``covers``).

Simplification: the prefix is copied, not shared by reference count with copy-on-write at the
boundary block; while both live the prefix takes its memory twice.
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

    def want(self, run_id: str) -> None:
        self._wanted.add(run_id)

    def tokens(self, run_id: str) -> int:
        """KV positions kept for ``run_id`` (0 if none)."""
        kept = self.runs.get(run_id)
        return 0 if kept is None else len(kept[1])

    def covers(self, run_id: str, token_ids, upto: int) -> bool:
        """Whether the kept run holds KV of exactly ``token_ids[:upto]`` (a prefix copied for
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

    def copy_prefix(self, run_id: str, table: list[int], upto: int) -> None:
        """Positions ``[0, upto)`` of the kept run's KV into the blocks ``table`` (every
        layer); ``ValueError`` if the run is not kept or holds fewer positions."""
        kept = self.runs.get(run_id)
        if kept is None or len(kept[1]) < upto:
            raise ValueError(f"no kept KV of {run_id!r} covering [0, {upto}) on this engine")
        cache = self.engine.cache
        if not hasattr(cache, "k"):   # EMULATION: no KV stored
            return
        bs = self.engine.blocks.block_size
        src = _slots(kept[0], upto, bs, cache.k[0].device)
        dst = _slots(table, upto, bs, cache.k[0].device)
        for layer in range(len(cache.k)):
            for t in (cache.k[layer], cache.v[layer]):
                flat = t.view(-1, *t.shape[2:])
                flat.index_copy_(0, dst, flat.index_select(0, src))

    def make_room(self, tokens: int, spare: str = "") -> list[str]:
        """Free kept runs, the earliest kept first (but ``spare``), until a reservation of
        ``tokens`` fits; the runs freed. Kept KV never makes the engine refuse a request."""
        dropped = []
        for run in list(self.runs):
            if self.engine.can_reserve(tokens):
                break
            if run != spare:
                self.drop(run)
                dropped.append(run)
        return dropped

    def drop(self, run_id: str) -> bool:
        """Free the run's kept blocks (and forget a wish to keep it); False if none."""
        self._wanted.discard(run_id)
        kept = self.runs.pop(run_id, None)
        if kept is None:
            return False
        self.engine.blocks.free_owned(run_id, kept[0])
        return True


def _slots(table: list[int], n: int, block_size: int, device) -> torch.Tensor:
    pos = torch.arange(n, device=device)
    blocks = torch.tensor(table, dtype=torch.int64, device=device)
    return blocks[pos // block_size] * block_size + pos % block_size
