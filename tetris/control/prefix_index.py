"""The prefix index: which token prefixes have KV cached, and where that KV lives.

A prompt is cut into blocks of ``block_tokens``; block ``k``'s hash covers block ``k - 1``'s
hash and block ``k``'s tokens (chained, so equal hashes mean equal whole prefixes). Only whole
blocks count: a prompt that shares 40 tokens with a cached one hits 32 of them at 16 tokens a
block. The hash is BLAKE2b over little-endian bytes, the same in every process (Python's
``hash()`` is salted per process and would make the live system and the simulator disagree).

Each cached block names its *source*: the run whose KV holds ``[0, that run's prompt)``, on
the prefill instances its plan's last group left it (``KvLocation``, ring order) and/or on a
decode instance. A source's KV holds every earlier block too, so the source of the last block
of a hit serves the whole hit. When a later run re-inserts blocks, they move to it (it holds
them as well, and the older copy can go).

Lifecycle of a run that uses the cache:

1. ``match(hashes)``: the longest cached prefix, nothing changes;
2. ``acquire(run_id, hit)``: the hit's blocks are referenced (never evicted) and its source
   pinned (never released) until
3. ``release(run_id)``: the run is over (idempotent, for every exit path);
4. ``insert(run_id, hashes, location)``: the run's prefill finished; its blocks are indexed,
   evicting the least recently used unreferenced blocks (deepest first on ties) past
   ``capacity_blocks``;
5. ``drain_released()``: sources none of whose blocks is indexed and none pinned: their KV
   may be freed by whoever holds it;
6. ``forget(source)``: the source's KV is gone (a worker replaced): its blocks stop matching at
   once and leave the index as soon as no run references them.

Pure: no Ray, no torch, no clock (recency is an insertion order).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgspec

__all__ = ["KvLocation", "PrefixHit", "PrefixIndex", "block_hashes", "chain_hash"]

_ROOT = 0


def chain_hash(parent: int, payload: bytes) -> int:
    """A block's 64-bit hash from its parent's hash and its payload (its tokens' bytes)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(payload)
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """Chained hashes of the prompt's whole blocks (a trailing partial block has none)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    out, parent = [], _ROOT
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start:start + block_tokens]
        parent = chain_hash(parent, struct.pack(f"<{block_tokens}q", *block))
        out.append(parent)
    return out


class KvLocation(msgspec.Struct, frozen=True):
    """Where a source run's KV lives: prefill instances in ring order (sharded as its ring
    left it; empty once freed there) and/or a decode instance (None if none)."""

    prefill_instances: tuple[int, ...] = ()
    decode_instance: int | None = None


class PrefixHit(msgspec.Struct, frozen=True):
    """The longest cached prefix of a prompt: ``blocks`` whole blocks, held by ``source``."""

    blocks: int = 0
    tokens: int = 0
    source: str = ""
    location: KvLocation = KvLocation()
    hashes: tuple[int, ...] = ()


class _Block:
    __slots__ = ("refs", "source")

    def __init__(self, source: str):
        self.source = source
        self.refs = 0


class PrefixIndex:
    """Cached blocks by chained hash, LRU among the unreferenced, at most ``capacity_blocks``."""

    def __init__(self, block_tokens: int, capacity_blocks: int) -> None:
        if block_tokens <= 0 or capacity_blocks < 0:
            raise ValueError("block_tokens must be positive and capacity_blocks >= 0")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[int, _Block] = {}
        self._free: dict[int, None] = {}        # unreferenced blocks, least recent first
        self._held: dict[str, PrefixHit] = {}   # run -> the hit it references
        self._sources: dict[str, KvLocation] = {}
        self._source_blocks: dict[str, int] = {}
        self._source_pins: dict[str, int] = {}
        self._released: list[str] = []
        self._dead: set[str] = set()            # forgotten sources still referenced
        # Announced at commit, prefill still running: never released, even with all its blocks
        # evicted (its KV is being written; freeing it would fail the run).
        self._computing: set[str] = set()
        self.queries = 0
        self.hits = 0
        self.hit_tokens = 0
        self.evictions = 0

    # -- queries ------------------------------------------------------------------------------
    def hashes(self, tokens: Sequence[int]) -> list[int]:
        return block_hashes(tokens, self.block_tokens)

    def match(self, hashes: Sequence[int]) -> PrefixHit:
        """The longest prefix of ``hashes`` whose blocks are all cached (no state changes
        but the hit counters)."""
        n = 0
        for h in hashes:
            b = self._blocks.get(h)
            if b is None or b.source in self._dead:
                break
            n += 1
        self.queries += 1
        if n == 0:
            return PrefixHit()
        self.hits += 1
        self.hit_tokens += n * self.block_tokens
        source = self._blocks[hashes[n - 1]].source
        return PrefixHit(n, n * self.block_tokens, source, self._sources[source],
                         tuple(hashes[:n]))

    def location(self, source: str) -> KvLocation | None:
        return self._sources.get(source)

    def holds(self, source: str) -> bool:
        """``source``'s KV is the index's (indexed, not forgotten): its owner must keep it."""
        return source in self._sources and source not in self._dead

    def __len__(self) -> int:
        return len(self._blocks)

    # -- references ---------------------------------------------------------------------------
    def acquire(self, run_id: str, hit: PrefixHit) -> None:
        """``run_id`` uses ``hit``: its blocks are not evicted nor its source released until
        ``release(run_id)``."""
        if run_id in self._held:
            raise ValueError(f"run {run_id!r} already holds a prefix")
        if not hit.blocks:
            return
        for h in hit.hashes:
            b = self._blocks[h]
            if b.refs == 0:
                del self._free[h]
            b.refs += 1
        self._source_pins[hit.source] = self._source_pins.get(hit.source, 0) + 1
        self._held[run_id] = hit

    def release(self, run_id: str) -> None:
        hit = self._held.pop(run_id, None)
        if hit is None:
            return
        # Deepest first, so the hit's leaves are evicted before its root on a tie.
        for h in reversed(hit.hashes):
            b = self._blocks[h]
            b.refs -= 1
            if b.refs == 0:
                if b.source in self._dead:   # its KV is gone: out of the index now
                    self._drop(h)
                else:
                    self._free[h] = None
        pins = self._source_pins[hit.source] - 1
        if pins:
            self._source_pins[hit.source] = pins
        else:
            del self._source_pins[hit.source]
            self._maybe_release(hit.source)

    def held(self, run_id: str) -> PrefixHit | None:
        return self._held.get(run_id)

    # -- insertion and eviction ---------------------------------------------------------------
    def insert(self, run_id: str, hashes: Sequence[int], location: KvLocation, *,
               rebind: bool = True) -> int:
        """Index the blocks of ``run_id``'s prompt, whose KV is at ``location``; returns how
        many blocks are indexed for it (fewer than ``hashes`` when the rest cannot fit).
        ``rebind=False`` (a run announced at commit, its KV still to come) leaves blocks another
        source holds with it (only recency changes), and a run given no block of its own is
        not a source at all (nothing of it is released)."""
        self._sources[run_id] = location
        self._source_blocks.setdefault(run_id, 0)
        n = 0
        touched: list[int] = []
        for h in hashes:
            b = self._blocks.get(h)
            if b is None:
                if len(self._blocks) >= self.capacity_blocks and not self._evict_one(touched):
                    break
                b = self._blocks[h] = _Block(run_id)
                self._source_blocks[run_id] += 1
            elif b.source != run_id and rebind:
                old, b.source = b.source, run_id
                self._source_blocks[run_id] += 1
                self._source_blocks[old] -= 1
                self._maybe_release(old)
            touched.append(h)
            n += 1
        # Most recent now; deepest first so that a chain's leaf goes before its root.
        for h in reversed(touched):
            if self._blocks[h].refs == 0:
                self._free.pop(h, None)
                self._free[h] = None
        if rebind:
            self._computing.discard(run_id)   # its KV is complete
            self._maybe_release(run_id)   # its KV exists: free it if nothing is indexed there
        elif not self._source_blocks.get(run_id) and run_id not in self._source_pins:
            # Announced before its KV exists, with nothing new: not a source, nothing to free.
            del self._sources[run_id]
            self._source_blocks.pop(run_id, None)
        else:
            self._computing.add(run_id)
        return n

    def _evict_one(self, keep: list[int]) -> bool:
        """Evict the least recently used unreferenced block not in ``keep`` (the chain being
        inserted: evicting its own parent would orphan it)."""
        keep_set = set(keep)
        victim = next((h for h in self._free if h not in keep_set), None)
        if victim is None:
            return False
        del self._free[victim]
        self.evictions += 1
        source = self._blocks.pop(victim).source
        self._source_blocks[source] -= 1
        self._maybe_release(source)
        return True

    def _maybe_release(self, source: str) -> None:
        if self._source_blocks.get(source, 0) == 0 and source not in self._source_pins \
                and source in self._sources and source not in self._computing:
            del self._sources[source]
            self._source_blocks.pop(source, None)
            self._dead.discard(source)
            self._released.append(source)

    def _drop(self, h: int) -> None:
        """Take an unreferenced block out (not in the free list)."""
        source = self._blocks.pop(h).source
        self._source_blocks[source] -= 1
        self._maybe_release(source)

    def forget(self, source: str) -> None:
        """``source``'s KV is gone: its blocks match no more and leave the index (at once, or
        when the last run referencing them lets go); released as usual once none is left."""
        if source not in self._sources:
            return
        self._computing.discard(source)   # no KV is coming from it
        self._dead.add(source)
        for h in [h for h, b in self._blocks.items() if b.source == source and not b.refs]:
            del self._free[h]
            self._drop(h)
        self._maybe_release(source)

    def drain_released(self) -> list[str]:
        """Sources whose KV nothing needs any longer, in the order they were let go."""
        out, self._released = self._released, []
        return out

    def clear(self) -> list[str]:
        """Drop every unreferenced block; returns the sources released (their KV may go)."""
        for h in list(self._free):
            del self._free[h]
            source = self._blocks.pop(h).source
            self._source_blocks[source] -= 1
            self._maybe_release(source)
        return self.drain_released()

    # -- accounting ---------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {"blocks": len(self._blocks), "free_blocks": len(self._free),
                "referenced_blocks": len(self._blocks) - len(self._free),
                "capacity_blocks": self.capacity_blocks, "sources": len(self._sources),
                "held_runs": len(self._held), "queries": self.queries, "hits": self.hits,
                "hit_tokens": self.hit_tokens, "evictions": self.evictions}

    def sources(self) -> list[str]:
        """The runs whose KV the index keeps (sorted): what the pools may hold for it."""
        return sorted(self._sources)

    def check(self) -> None:
        """Raise AssertionError unless every block is exactly one of referenced or free, the
        counts agree with the holders, and no source is kept without a block or a pin."""
        refs: dict[int, int] = {}
        pins: dict[str, int] = {}
        for hit in self._held.values():
            for h in hit.hashes:
                refs[h] = refs.get(h, 0) + 1
            pins[hit.source] = pins.get(hit.source, 0) + 1
        assert len(self._blocks) <= self.capacity_blocks, "over capacity"
        assert set(self._free) <= set(self._blocks), "a free entry names no block"
        per_source: dict[str, int] = {}
        for h, b in self._blocks.items():
            assert b.refs == refs.get(h, 0), f"block {h:x}: refs {b.refs} != {refs.get(h, 0)}"
            assert (b.refs == 0) == (h in self._free), f"block {h:x} is both or neither"
            per_source[b.source] = per_source.get(b.source, 0) + 1
        assert pins == self._source_pins, "source pins disagree with the held runs"
        kept = {s: c for s, c in self._source_blocks.items() if c}
        assert kept == per_source, "per-source block counts disagree"
        for s in self._sources:
            assert per_source.get(s) or pins.get(s) or s in self._computing, \
                f"source {s!r} kept for nothing"
        assert self._computing <= set(self._sources), "a computing run is no source"
        assert self._dead <= set(self._sources), "a forgotten source outlived its release"
        for h, b in self._blocks.items():
            assert b.source not in self._dead or b.refs, f"block {h:x} of a forgotten source"
        assert set(self._sources) >= set(per_source) | set(pins), "a block names a lost source"
