"""Zigzag layout of a chunk over its ring (SPEC §6, paper §4.1 "zigzag" partitioning).

A chunk ``[start, end)`` on a group of ``s`` members is cut into ``2s`` contiguous pieces;
member ``r`` takes pieces ``r`` and ``2s-1-r``. Causal attention inside the chunk then costs each
member about the same: an early piece (few keys) is paired with a late one (many keys).

When the chunk length ``L`` is not a multiple of ``2s`` the first ``L % 2s`` pieces are one token
longer; pieces may be empty when ``L < 2s`` (such a member still forwards KV around the ring).

Positions are kept as ranges: ``Ranges`` is a sorted tuple of disjoint half-open ``(lo, hi)``.
"""

from __future__ import annotations

__all__ = [
    "Ranges",
    "zigzag_pieces",
    "zigzag_ranges",
    "zigzag_layout",
    "ranges_len",
    "ranges_to_list",
    "normalize_ranges",
]

Ranges = tuple[tuple[int, int], ...]


def zigzag_pieces(start: int, end: int, sp_size: int) -> list[tuple[int, int]]:
    """The ``2 * sp_size`` contiguous pieces of ``[start, end)``, in position order."""
    if sp_size <= 0:
        raise ValueError(f"sp_size must be positive, got {sp_size}")
    if end < start:
        raise ValueError(f"chunk [{start}, {end}) is reversed")
    n = 2 * sp_size
    base, extra = divmod(end - start, n)
    pieces = []
    lo = start
    for j in range(n):
        hi = lo + base + (1 if j < extra else 0)
        pieces.append((lo, hi))
        lo = hi
    return pieces


def zigzag_ranges(start: int, end: int, sp_size: int, rank: int) -> Ranges:
    """Positions of member ``rank``: pieces ``rank`` and ``2*sp_size-1-rank`` (empty ones dropped)."""
    if not 0 <= rank < sp_size:
        raise ValueError(f"rank {rank} outside a ring of {sp_size}")
    pieces = zigzag_pieces(start, end, sp_size)
    return normalize_ranges([pieces[rank], pieces[2 * sp_size - 1 - rank]])


def zigzag_layout(start: int, end: int, sp_size: int) -> tuple[Ranges, ...]:
    """Every member's positions, in ring order."""
    return tuple(zigzag_ranges(start, end, sp_size, r) for r in range(sp_size))


def normalize_ranges(ranges) -> Ranges:
    """Sort, drop empty ranges and join touching ones."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and lo <= out[-1][1]:
            if lo < out[-1][1]:
                raise ValueError(f"overlapping ranges at {lo}")
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def ranges_len(ranges: Ranges) -> int:
    return sum(hi - lo for lo, hi in ranges)


def ranges_to_list(ranges: Ranges) -> list[int]:
    return [p for lo, hi in ranges for p in range(lo, hi)]
