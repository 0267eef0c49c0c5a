"""Where the dispatcher sends a request among decode units of different sizes (KunServe §3).

KunServe's dispatcher balances load the Llumnix way. Before a drop every unit is one instance
with the same KV, and "the unit with the most free blocks" balances them. After a drop a
group of g members is one unit with g instances' compute and more KV than g instances (the
freed parameters): by free blocks alone it looks like the emptiest unit until its free blocks
fall to a single instance's, so it takes nearly every new request and its members run
batches several times a single's (seen in the 72B SIMULATION after a burst: 75-86 sequences
per group member against 3-8 on each single, the group's iteration 28-30 ms against 12-13 ms)
and, kept busy, it misses its restore (§4.4).

A group block holds a block of tokens of every layer spread over the members, so a unit's
used blocks over its members are the tokens each member's layers hold: the KV each member
reads, and with it the sequences each member runs. The request goes to the unit with the
fewest used blocks per member among those with room for it; it waits when none has room
(the head of the FCFS queue is never skipped). Among equal instances this is the most free
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
    members: int
    used: int
    free: int


def route(need: int, rooms: Sequence[UnitRoom]) -> int | None:
    """Index in ``rooms`` of the unit a request needing ``need`` blocks goes to (module
    docstring), or None when no unit has room for it."""
    best, best_key = None, None
    for i, room in enumerate(rooms):
        if room.free < need:
            continue
        key = (Fraction(room.used, room.members), room.leader)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best
