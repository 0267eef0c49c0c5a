"""The one queue-time model: until when each prefill instance is busy (paper Eq. 2).

The scheduler plans against a ``PoolState`` snapshot of this queue; both drivers of the
control plane (the live dispatcher and the simulator) keep exactly one ``PrefillQueue`` and
tell it the same four things:

1. ``commit(plan)``: Eq. 2. Every member of a chunk's group is booked until that chunk's
   ``expected_end`` (a ring needs all members at once; later, larger chunks extend the hold
   of the members they keep). Bookings are kept per run id.
2. ``finish(run_id, now)``: the run's prefill ended (or the run was abandoned). Its bookings
   go; an instance that finished early is free from ``now``, one that ran late from ``now``.
3. ``observe(busy_for, now)``: the pool's own report, seconds of committed work left per
   instance, kept as a floor (the pool knows of stalls, e.g. a worker being replaced, that
   the bookings do not).
4. ``hold(instances, until)``: plan nothing on them before ``until`` (drain, maintenance).

A booking whose expected end has passed while its run has not finished is a chunk running
late: the instance counts as busy *now* (its true end is unknown). An instance without
bookings keeps the time it became free, which may lie in the past: the search starts such an
instance at ``now`` and prefers, among otherwise equal ones, the one idle longest.

Pure bookkeeping: no clock, no I/O; times are absolute on the driver's clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tetris.plan import PrefillPlan
from tetris.scheduler.pool import PoolState

__all__ = ["PrefillQueue"]


class PrefillQueue:
    """Per-instance bookings of committed plans, a free-time floor and the pool's report."""

    # An instance reported busy for ever (its worker is being replaced) counts as busy this
    # much longer; the next report says more.
    REPLACING_S = 60.0

    def __init__(self, node_of: Sequence[int]) -> None:
        self.node_of = tuple(int(n) for n in node_of)
        if not self.node_of:
            raise ValueError("a prefill pool needs at least one instance")
        n = len(self.node_of)
        self._booked: list[dict[str, float]] = [{} for _ in range(n)]
        self._free_from = [0.0] * n     # finished runs' ends and holds
        self._reported = [0.0] * n      # busy-until by the pool's last report

    @property
    def size(self) -> int:
        return len(self.node_of)

    def commit(self, plan: PrefillPlan) -> None:
        """Paper Eq. 2: each member of a chunk's group is busy until the chunk's expected end."""
        plan.validate(self.size)
        rid = plan.request_id
        for chunk in plan.chunks:
            for i in chunk.instances:
                booked = self._booked[i]
                if booked.get(rid, -1.0) < chunk.expected_end:
                    booked[rid] = chunk.expected_end

    def finish(self, run_id: str, now: float) -> None:
        """The run's prefill is over (done, failed or abandoned): free what it booked."""
        for i, booked in enumerate(self._booked):
            end = booked.pop(run_id, None)
            if end is not None:
                self._free_from[i] = max(self._free_from[i], min(end, now))

    def hold(self, instances: Sequence[int], until: float) -> None:
        """Plan no work on ``instances`` before ``until``; running work goes on."""
        for i in instances:
            if not 0 <= i < self.size:
                raise ValueError(f"no prefill instance {i} (pool of {self.size})")
        for i in instances:
            self._free_from[i] = max(self._free_from[i], float(until))

    def observe(self, busy_for: Sequence[float], now: float) -> None:
        """The pool's report at ``now``: per instance, seconds of committed work left
        (negative: idle for that long; infinite: its worker is being replaced)."""
        if len(busy_for) != self.size:
            raise ValueError(f"the pool reported {len(busy_for)} instances, the queue has "
                             f"{self.size}")
        self._reported = [now + (b if math.isfinite(b) else self.REPLACING_S)
                          for b in map(float, busy_for)]

    def queue_times(self, now: float) -> list[float]:
        out = []
        for booked, free_from, reported in zip(self._booked, self._free_from, self._reported):
            t = free_from if free_from > reported else reported
            for end in booked.values():
                end = end if end > now else now    # running late: busy now
                if end > t:
                    t = end
            out.append(t)
        return out

    def pool_state(self, now: float) -> PoolState:
        """The snapshot a policy plans on."""
        return PoolState(self.queue_times(now), self.node_of)

    def bookings(self) -> int:
        """Runs' bookings still held, over all instances (zero when nothing runs)."""
        return sum(len(b) for b in self._booked)
