"""Per-worker paged KV storage, keyed by request and absolute token position.

A prefill worker holds pieces of many requests' KV: its zigzag shares of their chunks and the
history it received by cache balancing. Positions of one request on one worker are therefore
an arbitrary sorted set, not a prefix. Each request owns whole blocks of
``[num_blocks, block_size, Hkv, D]`` caches (one pair per layer, the engine's layout); a slot is
``block * block_size + offset``. Slots are reserved for a set of positions before a chunk runs,
written layer by layer as layers finish, and released when positions move to another worker,
when the request's KV has been handed off, or when the request is aborted.

Thread safety: a worker runs one chunk at a time, but a cached prefix is exported from its
transfer thread while the default thread runs another request's chunk (``export_below``,
actors/prefill/prefix_move.py). Block bookkeeping (reserve, release, free, copy) and that export
hold ``lock``, so the exported run's blocks cannot be freed and given to another request in the
middle of the read; reads and writes of a request's own slots need no lock.
"""

from __future__ import annotations

import functools
import threading

import torch

from tetris.actors.prefill.zigzag import Ranges

__all__ = ["KVCapacityError", "PagedKVStore", "ranges_tensor"]


class KVCapacityError(RuntimeError):
    """Not enough free blocks for a reservation; nothing was reserved."""


def ranges_tensor(ranges: Ranges) -> torch.Tensor:
    """int64 [n] positions of ``ranges`` in order."""
    if not ranges:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(lo, hi, dtype=torch.int64) for lo, hi in ranges])


def _locked(method):
    """Run ``method`` holding the store's ``lock`` (see the module's thread safety)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return locked


class _RequestKV:
    __slots__ = ("pos", "slot", "blocks", "free_slots")

    def __init__(self) -> None:
        self.pos = torch.empty(0, dtype=torch.int64)    # sorted absolute positions
        self.slot = torch.empty(0, dtype=torch.int64)   # slot of pos[i]
        self.blocks: list[int] = []
        self.free_slots: list[int] = []                  # unused slots inside owned blocks


class PagedKVStore:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype=torch.float32, device="cpu") -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("KV store sizes must be positive")
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # k_cache[i], v_cache[i]: [num_blocks, block_size, Hkv, D]
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free_blocks = list(range(num_blocks - 1, -1, -1))   # pop() gives block 0 first
        self._reqs: dict[str, _RequestKV] = {}
        self.lock = threading.RLock()   # block bookkeeping vs. an export from another thread

    # -- bookkeeping --------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def requests(self) -> list[str]:
        return sorted(self._reqs)

    def positions(self, request_id: str) -> torch.Tensor:
        """int64 [n] sorted positions held for the request (empty if none)."""
        entry = self._reqs.get(request_id)
        return entry.pos.clone() if entry else torch.empty(0, dtype=torch.int64)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        entry = self._reqs.get(request_id)
        spare = len(entry.free_slots) if entry else 0
        return max(0, -(-(num_tokens - spare) // self.block_size))

    def can_reserve(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= len(self._free_blocks)

    @_locked
    def reserve(self, request_id: str, positions: Ranges) -> None:
        """Reserve slots for new positions of a request (all or nothing)."""
        pos = ranges_tensor(positions)
        n = pos.numel()
        if n == 0:
            return
        if not self.can_reserve(request_id, n):
            raise KVCapacityError(
                f"request {request_id}: {n} tokens need {self.blocks_needed(request_id, n)} "
                f"blocks, {len(self._free_blocks)} free"
            )
        entry = self._reqs.setdefault(request_id, _RequestKV())
        if entry.pos.numel() and torch.isin(pos, entry.pos).any():
            raise ValueError(f"request {request_id}: positions already stored")
        while len(entry.free_slots) < n:
            b = self._free_blocks.pop()
            entry.blocks.append(b)
            base = b * self.block_size
            entry.free_slots.extend(range(base + self.block_size - 1, base - 1, -1))
        slots = torch.tensor([entry.free_slots.pop() for _ in range(n)], dtype=torch.int64)
        all_pos = torch.cat([entry.pos, pos])
        all_slot = torch.cat([entry.slot, slots])
        order = torch.argsort(all_pos)
        entry.pos, entry.slot = all_pos[order], all_slot[order]

    @_locked
    def release(self, request_id: str, positions: Ranges) -> None:
        """Free the slots of some positions (moved elsewhere); emptied blocks return to the pool."""
        entry = self._reqs.get(request_id)
        if entry is None:
            return
        idx = self._index(request_id, entry, ranges_tensor(positions))
        keep = torch.ones(entry.pos.numel(), dtype=torch.bool)
        keep[idx] = False
        entry.free_slots.extend(entry.slot[idx].tolist())
        entry.pos, entry.slot = entry.pos[keep], entry.slot[keep]
        self._return_empty_blocks(entry)
        if entry.pos.numel() == 0:
            self.free(request_id)

    @_locked
    def free(self, request_id: str) -> int:
        """Free everything the request holds; returns the number of blocks freed."""
        entry = self._reqs.pop(request_id, None)
        if entry is None:
            return 0
        self._free_blocks.extend(reversed(entry.blocks))
        return len(entry.blocks)

    def _return_empty_blocks(self, entry: _RequestKV) -> None:
        used = set((entry.slot // self.block_size).tolist())
        freed = [b for b in entry.blocks if b not in used]
        if not freed:
            return
        entry.blocks = [b for b in entry.blocks if b in used]
        self._free_blocks.extend(freed)
        gone = set(freed)
        entry.free_slots = [s for s in entry.free_slots if s // self.block_size not in gone]

    def _index(self, request_id: str, entry: _RequestKV, pos: torch.Tensor) -> torch.Tensor:
        idx = torch.searchsorted(entry.pos, pos)
        ok = idx < entry.pos.numel()
        if not bool(ok.all()) or not torch.equal(entry.pos[idx], pos):
            raise KeyError(f"request {request_id}: some positions are not stored here")
        return idx

    def slots(self, request_id: str, positions: Ranges) -> torch.Tensor:
        if not positions:
            return torch.empty(0, dtype=torch.int64)
        entry = self._reqs.get(request_id)
        if entry is None:
            raise KeyError(f"request {request_id}: no KV stored here")
        return entry.slot[self._index(request_id, entry, ranges_tensor(positions))]

    # -- data ---------------------------------------------------------------------------------
    def write(self, request_id: str, layer: int, positions: Ranges, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v: [n, Hkv, D] for ``positions`` in order."""
        slots = self.slots(request_id, positions)
        self.k_cache[layer].view(-1, *k.shape[1:])[slots] = k
        self.v_cache[layer].view(-1, *v.shape[1:])[slots] = v

    def read(self, request_id: str, layer: int, positions: Ranges) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each [n, Hkv, D], for ``positions`` in order."""
        slots = self.slots(request_id, positions)
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        return kc.view(-1, *kc.shape[2:])[slots], vc.view(-1, *vc.shape[2:])[slots]

    @_locked
    def copy_prefix(self, source: str, request_id: str, upto: int) -> Ranges:
        """Prefix caching: give ``request_id`` its own copy of ``source``'s KV at positions
        below ``upto`` held here (all layers); returns those positions as ranges."""
        entry = self._reqs.get(source)
        if entry is None or request_id == source:
            return ()
        n = int((entry.pos < upto).sum())   # pos is sorted: the first n
        if n == 0:
            return ()
        pos = entry.pos[:n].tolist()
        ranges, lo = [], pos[0]
        for a, b in zip(pos, pos[1:] + [None]):
            if b != a + 1:
                ranges.append((lo, a + 1))
                lo = b
        ranges = tuple(ranges)
        src = entry.slot[:n].clone()
        self.reserve(request_id, ranges)
        dst = self.slots(request_id, ranges)
        for cache in (*self.k_cache, *self.v_cache):
            flat = cache.view(-1, *cache.shape[2:])   # [num_blocks * block_size, Hkv, D]
            flat[dst] = flat[src]
        return ranges

    @_locked
    def export_below(self, source: str, upto: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [n], k [L, n, Hkv, D], v [L, n, Hkv, D]) of ``source``'s KV held here
        below ``upto``, read under ``lock`` (safe beside another request's chunk)."""
        entry = self._reqs.get(source)
        n = 0 if entry is None else int((entry.pos < upto).sum())   # pos is sorted: the first n
        if n == 0:
            kc = self.k_cache[0]
            empty = torch.empty((self.num_layers, 0, *kc.shape[2:]), dtype=kc.dtype)
            return torch.empty(0, dtype=torch.int64), empty, empty.clone()
        slots = entry.slot[:n]
        ks = torch.stack([c.view(-1, *c.shape[2:])[slots] for c in self.k_cache])
        vs = torch.stack([c.view(-1, *c.shape[2:])[slots] for c in self.v_cache])
        return entry.pos[:n].clone(), ks, vs

    def empty_rows(self, n: int, pairs: int = 2) -> torch.Tensor:
        """A receive buffer [n, pairs, Hkv, D] of the cache dtype."""
        kc = self.k_cache[0]
        return torch.empty((n, pairs, *kc.shape[2:]), dtype=kc.dtype, device=kc.device)

    def export(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [n], k [L, n, Hkv, D], v [L, n, Hkv, D]): the request's KV held here."""
        entry = self._reqs.get(request_id)
        if entry is None:
            kc = self.k_cache[0]
            empty = torch.empty((self.num_layers, 0, *kc.shape[2:]), dtype=kc.dtype)
            return torch.empty(0, dtype=torch.int64), empty, empty.clone()
        ks = [self.k_cache[i].view(-1, *self.k_cache[i].shape[2:])[entry.slot]
              for i in range(self.num_layers)]
        vs = [self.v_cache[i].view(-1, *self.v_cache[i].shape[2:])[entry.slot]
              for i in range(self.num_layers)]
        return entry.pos.clone(), torch.stack(ks), torch.stack(vs)
