"""Where the dispatcher sends a request among decode units of different sizes (KunServe §3).

KunServe's dispatcher balances load the Llumnix way. Before a drop every unit is one instance
with the same KV, and "the unit with the most free blocks" balances them. After a drop a
group of g members is one unit with g instances' compute and more KV than g instances (the
freed parameters): by free blocks alone it looks like the emptiest unit until its free blocks
fall to a single instance's, so it takes nearly every new request, its members run batches
several times a single's (seen in the 72B SIMULATION after a LongBench-shaped burst: 75-86
sequences per group member against 3-8 on each single, the group's iteration 28-30 ms
against 12-13 ms) and, kept busy, it misses its restore (§4.4).

The request goes instead to the unit with room for it whose KV is the least used as a share
of its capacity; it waits when none has room (the head of the FCFS queue is never skipped).
Equal shares keep every unit equally far from preempting (what Llumnix balances), and put on
a group member about as many tokens as on a single, times the member's larger capacity
(1.44x for a 72B group of 2). Balancing the used blocks per member exactly was tried too: the
same TPOT, but singles then run full while the group has room, and their decodes are
preempted (54 against 8 in the 72B issue trace). Among equal instances this is the most free
blocks, as before, ties to the lowest instance. Pure: no torch, no ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

__all__ = ["UnitRoom", "route"]


class UnitRoom(NamedTuple):
    """One open unit's KV as the dispatcher sees it, in blocks."""

    leader: int       # its first member: ties go to the lowest
    used: int
    free: int


def route(need: int, rooms: Sequence[UnitRoom]) -> int | None:
    """Index in ``rooms`` of the unit a request needing ``need`` blocks goes to (module
    docstring), or None when no unit has room for it."""
    best, best_key = None, None
    for i, room in enumerate(rooms):
        if room.free < need:
            continue
        key = (Fraction(room.used, room.used + room.free), room.leader)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best
