"""The event queue of the discrete-event simulator.

Events are ordered by ``(time, kind, sequence)``: at equal times, completions are handled before
new arrivals (so a decision made at time ``t`` sees every slot freed at ``t``), and
the insertion sequence breaks the remaining ties, which makes a run a pure function of its inputs.
"""

from __future__ import annotations

import heapq
from enum import IntEnum
from typing import Any

__all__ = ["EventKind", "EventQueue"]


class EventKind(IntEnum):
    """Kinds in the order they are handled at equal times."""

    KV_READY = 0        # the last byte of a request's KV reached its decode instance
    DECODE_STEP = 1     # a decode instance finished one iteration of its batch (frees KV)
    PREFILL_DONE = 2    # a request's last chunk ended: the control plane frees its bookings
    ARRIVAL = 3         # a request arrives and is planned (θ updates ride on arrivals)


class EventQueue:
    """A min-heap of ``(time, kind, seq, payload)`` tuples."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0

    def push(self, time: float, kind: EventKind, payload: Any = None) -> None:
        if time != time:  # NaN would silently break the heap order
            raise ValueError(f"event time must be a number, got {time}")
        heapq.heappush(self._heap, (time, int(kind), self._seq, payload))
        self._seq += 1

    def pop(self) -> tuple[float, EventKind, Any]:
        time, kind, _, payload = heapq.heappop(self._heap)
        return time, EventKind(kind), payload

    def peek_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
