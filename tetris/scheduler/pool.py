"""The prefill pool as a policy sees it: when each instance becomes free, and where it is.

A snapshot: the control plane's ``PrefillQueue`` (``tetris.control.queue``, paper Eq. 2) makes
one for every plan; policies only read it.
"""

from __future__ import annotations

from typing import Iterable, Sequence


__all__ = ["PoolError", "PoolState"]


class PoolError(ValueError):
    """A pool description is inconsistent."""


class PoolState:
    """``queue_times[i]``: absolute time instance ``i`` becomes free; ``node_of[i]``: its node."""

    __slots__ = ("queue_times", "node_of")

    def __init__(self, queue_times: Iterable[float], node_of: Sequence[int]):
        self.queue_times: list[float] = [float(q) for q in queue_times]
        self.node_of: tuple[int, ...] = tuple(int(n) for n in node_of)
        if not self.queue_times:
            raise PoolError("a prefill pool needs at least one instance")
        if len(self.node_of) != len(self.queue_times):
            raise PoolError(
                f"{len(self.queue_times)} queue times but {len(self.node_of)} node indices"
            )
        if min(self.node_of) < 0:
            raise PoolError("node indices must be non-negative")

    @classmethod
    def uniform(cls, num_instances: int, node_size: int,
                queue_times: Iterable[float] | None = None) -> "PoolState":
        """``num_instances`` instances, ``node_size`` per node, numbered node by node."""
        if num_instances <= 0 or node_size <= 0 or num_instances % node_size:
            raise PoolError(
                f"pool of {num_instances} instances cannot be cut into nodes of {node_size}"
            )
        qs = [0.0] * num_instances if queue_times is None else list(queue_times)
        return cls(qs, [i // node_size for i in range(num_instances)])

    @property
    def size(self) -> int:
        return len(self.queue_times)

    @property
    def node_size(self) -> int:
        """The largest number of instances on one node."""
        counts: dict[int, int] = {}
        for n in self.node_of:
            counts[n] = counts.get(n, 0) + 1
        return max(counts.values())

    def copy(self) -> "PoolState":
        new = PoolState.__new__(PoolState)
        new.queue_times = list(self.queue_times)
        new.node_of = self.node_of
        return new

    def __repr__(self) -> str:
        return f"PoolState(queue_times={self.queue_times}, node_of={self.node_of})"
