"""Which prompt positions an emulated prefill worker would hold KV for (EMULATION).

The emulated executor computes nothing and stores no KV, yet prefix caching needs to know, per
instance, which positions of a cached run lie there: a plan from a cached prefix is accepted only
when its holders' copies are exactly ``[0, cached_tokens)`` (``actors/prefill/prefix.py``), and
``/admin/held`` must show what the cache keeps. ``EmulatedHoldings`` keeps the positions as the
real ``PagedKVStore`` would hold them (a chunk's share and the history balancing moves in are
reserved at ``prepare``; what balancing sends away is dropped after the chunk), without memory:
ranges only, so a 128k-token prompt costs a few tuples.
"""

from __future__ import annotations

from tetris.actors.prefill.zigzag import Ranges, normalize_ranges

__all__ = ["EmulatedHoldings", "subtract_ranges"]


def subtract_ranges(a: Ranges, b: Ranges) -> Ranges:
    """Positions of normalized ranges ``a`` not in normalized ranges ``b``."""
    out: list[tuple[int, int]] = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while lo < hi and k < len(b) and b[k][0] < hi:
            if b[k][0] > lo:
                out.append((lo, b[k][0]))
            lo = max(lo, b[k][1])
            k += 1
        if lo < hi:
            out.append((lo, hi))
    return tuple(out)


class EmulatedHoldings:
    """request id -> the positions this instance holds (as ``PagedKVStore`` would)."""

    def __init__(self) -> None:
        self._held: dict[str, Ranges] = {}

    def reserve(self, request_id: str, ranges) -> None:
        old = self._held.get(request_id, ())
        self._held[request_id] = normalize_ranges(list(old) + list(subtract_ranges(
            normalize_ranges(list(ranges)), old)))

    def release(self, request_id: str, ranges) -> None:
        """Drop ``ranges`` (sent away by cache balancing); the entry stays while it holds any."""
        if request_id in self._held:
            self._held[request_id] = subtract_ranges(self._held[request_id],
                                                     normalize_ranges(list(ranges)))

    def free(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def ranges(self, request_id: str) -> Ranges:
        return self._held.get(request_id, ())

    def requests(self) -> list[str]:
        return sorted(self._held)

    def copy_prefix(self, source: str, request_id: str, upto: int) -> Ranges:
        """``PagedKVStore.copy_prefix`` without KV: ``request_id`` now holds ``source``'s
        positions below ``upto`` held here too (each run is freed on its own); returns them."""
        if source not in self._held or request_id == source:
            return ()
        below = tuple((lo, min(hi, upto)) for lo, hi in self._held[source] if lo < upto)
        if below:
            self.reserve(request_id, below)
        return below
