"""When each running request's KV exchange ends after a drop or a restore (KunServe §4.2).

A request that changes unit waits for the KV of the layers it now runs elsewhere:
``bytes (g - 1) / g`` of its blocks. The old unit's requests share its members' links, so
their exchanges end one after another, not each after its own bytes alone: request k is ready
when the bytes of requests 1..k have crossed (the artifact moves its stale requests in small
batches, in order; the paper's 1-2 s stall is this whole queue, §4.2). The old unit's members
send at once, each over its own link. Used alike by the SIMULATION (``KunServeSim._place``)
and the EMULATION's regrouping (``tetris/bench/kunserve_regroup.py``).
"""

from __future__ import annotations

__all__ = ["ExchangeQueue"]


class ExchangeQueue:
    """The exchange out of one old unit of ``senders`` members, starting at ``start``."""

    __slots__ = ("rate", "t")

    def __init__(self, start: float, senders: int, link_bytes_per_s: float) -> None:
        self.t = start
        self.rate = senders * link_bytes_per_s

    def send(self, nbytes: float) -> float:
        """Queue one request's bytes; when they have all arrived."""
        self.t += nbytes / self.rate
        return self.t
