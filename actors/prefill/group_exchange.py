"""What every SP layout's member does to talk to its chunk group: post sends and receives on
the chunk's world, wait for them with the chunk's timeout, and account for the wait.

``RingAttention`` (ring.py), ``AllToAllAttention`` (alltoall.py) and ``SpTpAttention``
(sptp.py) differ in what they send; the posting of one exchange among all members
(``_post`` / ``_exchange``) and the waiting (``_wait`` / ``_await``) are this class's.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from tetris.actors.prefill.world import DefaultWorld, PeerLink

__all__ = ["GroupExchange"]


class GroupExchange:
    """Member ``rank`` of the chunk group ``group`` (world ranks in group order) on ``link``
    (default: the process's default group); ``tag`` keeps the chunk's messages apart."""

    def __init__(self, group: tuple[int, ...], rank: int, tag: int, timeout_s: float,
                 link: PeerLink | None = None) -> None:
        self.link = link or DefaultWorld()
        self.group = group
        self.rank = rank
        self.tag = tag
        self.timeout = timedelta(seconds=timeout_s)
        self.comm_wait_s = 0.0
        self.sent_elements = 0     # per chunk, every exchange: the volume, measured

    @property
    def sp_size(self) -> int:
        return len(self.group)

    def _step_name(self, layer: int, which: int) -> str:
        """How a timed-out exchange is named in its error."""
        return f"exchange {which} of layer {layer}"

    def _exchange(self, outgoing, in_sizes, dtype, layer: int, which: int) -> list[torch.Tensor]:
        """Send outgoing[j] to member j and receive in_sizes[j] elements from it (own: kept)."""
        incoming, works = self._post(outgoing, in_sizes, dtype)
        self._wait(works, layer, which)
        return incoming

    def _post(self, outgoing, in_sizes, dtype):
        """Post the sends and receives of one exchange; (buffers, works) to wait on later."""
        s, r = self.sp_size, self.rank
        incoming = [outgoing[r] if j == r
                    else torch.empty(in_sizes[j], dtype=dtype, device=outgoing[r].device)
                    for j in range(s)]
        sends = [(outgoing[j], self.group[j]) for j in range(s)
                 if j != r and outgoing[j].numel()]
        recvs = [(incoming[j], self.group[j]) for j in range(s) if j != r and in_sizes[j]]
        self.sent_elements += sum(t.numel() for t, _ in sends)
        return incoming, self.link.exchange(sends, recvs, self.tag)

    def _wait(self, works, layer: int, which: int) -> None:
        self._await(works, self._step_name(layer, which))

    def _await(self, works, what: str) -> None:
        """Wait for ``works``; a work not done within the timeout raises ``what`` timed out."""
        t0 = time.perf_counter()
        for w in works:
            if not w.wait(self.timeout):
                raise TimeoutError(f"{what} timed out")
        self.comm_wait_s += time.perf_counter() - t0
