"""A decode rank's control-plane counters (``DecodeRank.control_counts``): the rounds it
stepped and was called for, and the transfer calls and messages it took and sent, so the
fidelity benchmark measures the control plane's cost instead of estimating it."""

from __future__ import annotations

import threading

__all__ = ["ControlCounts", "CountingPeer"]


class ControlCounts:
    """Cumulative control-plane counters of one rank (updated from two threads: a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.ray_rounds = 0   # ``round`` calls from the driver (rank 0 only under lockstep)
        self.calls_in = 0
        self.calls_out = 0
        self.msgs: dict[str, int] = {}

    def received(self, msgs) -> None:
        with self._lock:
            self.calls_in += 1
            for m in msgs:
                key = f"in:{type(m).__name__}"
                self.msgs[key] = self.msgs.get(key, 0) + 1

    def sent(self, msgs) -> None:
        with self._lock:
            self.calls_out += 1
            for m in msgs:
                key = f"out:{type(m).__name__}"
                self.msgs[key] = self.msgs.get(key, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"steps": self.steps, "ray_rounds": self.ray_rounds,
                    "transfer_calls_in": self.calls_in,
                    "transfer_calls_out": self.calls_out} | dict(sorted(self.msgs.items()))


class CountingPeer:
    """A sender actor handle whose ``deliver_transfer.remote`` calls are counted."""

    def __init__(self, handle, counts: ControlCounts) -> None:
        self._handle = handle
        self._counts = counts
        self.deliver_transfer = self

    def remote(self, msgs):
        self._counts.sent(msgs)
        return self._handle.deliver_transfer.remote(msgs)

    def __eq__(self, other) -> bool:
        # the same actor, however wrapped: the pump tells a replaced sender by this
        return isinstance(other, CountingPeer) and self._handle == other._handle

    def __hash__(self) -> int:
        return hash(self._handle)
