"""Commit-order tickets: the chunks of concurrent plans start on shared instances in one order.

Two threads that submit the chunks of two requests to overlapping worker sets in opposite
orders deadlock: each worker runs one chunk at a time, so each ring waits for a member that is
busy with the other ring. Tickets remove the cycle. ``commit(plan)`` appends one ticket per
(chunk, instance) to that instance's queue, in the order plans are committed (the dispatcher
commits in the order it planned). A chunk may start only when its ticket is the oldest
unfinished one on every member instance. All tickets then follow one global order (commit
order, chunk order within a plan), and the oldest unfinished ticket of the whole pool can
always start, so some chunk always makes progress. Chunks of disjoint groups run concurrently.

A plan's tickets leave when its chunks end, when its ``run`` ends, or when it is cancelled;
a cancelled plan that has not started never blocks later ones, and its ``run`` fails. A plan
cancelled while a chunk executes keeps that chunk's ticket until the chunk ends, so the next
plan's members do not sit in a ring waiting for a member that is still busy.

``busy_for`` replays the tickets by the same rule to say how long each instance is still
busy: the dispatcher's bookings only know when chunks were *planned* to end, and once the pool
runs late (a worker died and was replaced, a chunk ran long) they say "free now" while the
tickets say otherwise.
"""

from __future__ import annotations

import threading
import time

from tetris.actors.prefill.messages import PrefillError
from tetris.plan import PlanError, PrefillPlan

__all__ = ["ChunkTickets"]

Ticket = tuple[str, int]   # (request_id, chunk_index)


class ChunkTickets:
    def __init__(self, pool_size: int) -> None:
        self._cond = threading.Condition()
        self._queues: list[list[Ticket]] = [[] for _ in range(pool_size)]
        self._plans: dict[str, PrefillPlan] = {}   # committed, not finished
        self._running: set[str] = set()
        # running request -> (the chunk now executing, when it started)
        self._current: dict[str, tuple[int, float]] = {}
        self._cancelled: set[str] = set()           # cancelled before their run started
        self._aborted: set[str] = set()             # cancelled while their run was under way
        self._progress = 0                          # tickets removed so far (stall detection)
        self._commits = 0                           # plans committed so far
        self._number: dict[str, int] = {}           # committed plan -> its commit number

    def commit(self, plan: PrefillPlan) -> None:
        """Queue the plan's chunks behind every plan committed before it."""
        with self._cond:
            if plan.request_id in self._plans:
                raise PlanError(f"request {plan.request_id} is already committed")
            self._cancelled.discard(plan.request_id)
            self._plans[plan.request_id] = plan
            self._commits += 1
            self._number[plan.request_id] = self._commits
            for k, chunk in enumerate(plan.chunks):
                for i in chunk.instances:
                    self._queues[i].append((plan.request_id, k))

    def start(self, plan: PrefillPlan) -> None:
        """``run`` begins: commit the plan unless it was; fail a cancelled or running one."""
        rid = plan.request_id
        with self._cond:
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                raise PrefillError(f"request {rid} was aborted before its prefill started")
            if rid in self._running:
                raise PlanError(f"request {rid} is already running")
            committed = self._plans.get(rid)
            if committed is None:
                self.commit(plan)
            elif committed != plan:
                raise PlanError(f"request {rid} was committed with another plan")
            self._running.add(rid)

    def wait_turn(self, request_id: str, k: int, stall_s: float) -> None:
        """Block until chunk ``k``'s ticket heads the queue of each member instance.

        Raises ``PrefillError`` if the request is cancelled meanwhile, or if no ticket of the
        pool finishes for ``stall_s`` (a committed plan whose ``run`` never came).
        """
        me = (request_id, k)
        with self._cond:
            plan = self._plans.get(request_id)
            if plan is None:
                raise PrefillError(f"request {request_id} was aborted")
            instances = plan.chunks[k].instances
            seen, deadline = self._progress, time.monotonic() + stall_s
            while True:
                if request_id in self._aborted:
                    raise PrefillError(f"request {request_id} was aborted during its prefill")
                if all(self._queues[i][0] == me for i in instances):
                    self._current[request_id] = (k, time.monotonic())
                    return
                if self._progress != seen:
                    seen, deadline = self._progress, time.monotonic() + stall_s
                left = deadline - time.monotonic()
                if left <= 0:
                    ahead = sorted({self._queues[i][0][0] for i in instances
                                    if self._queues[i][0] != me})
                    raise PrefillError(f"request {request_id} chunk {k} waited {stall_s:g}s "
                                       f"without progress behind requests {ahead}")
                self._cond.wait(left)

    def wait_gone(self, request_id: str, instances, stall_s: float) -> None:
        """Block until ``request_id`` has no ticket left on ``instances`` (a moved prefix's
        source is done with its holders). Committed earlier, its chunks never wait for the
        caller's; raises ``PrefillError`` if no ticket of the pool finishes for ``stall_s``."""
        with self._cond:
            seen, deadline = self._progress, time.monotonic() + stall_s
            while any(t[0] == request_id for i in instances for t in self._queues[i]):
                if self._progress != seen:
                    seen, deadline = self._progress, time.monotonic() + stall_s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PrefillError(f"request {request_id} held instances {list(instances)} "
                                       f"for {stall_s:g}s without progress")
                self._cond.wait(left)

    def chunk_done(self, request_id: str, k: int) -> None:
        with self._cond:
            self._current.pop(request_id, None)
            plan = self._plans.get(request_id)
            if plan is not None:
                self._remove(plan.chunks[k].instances, lambda t: t == (request_id, k))

    def finish(self, request_id: str) -> None:
        """``run`` ended (either way): every ticket of the plan goes."""
        with self._cond:
            self._running.discard(request_id)
            self._aborted.discard(request_id)
            self._current.pop(request_id, None)
            self._drop(request_id)

    def cancel(self, request_id: str) -> None:
        """Abort: drop the plan's tickets; its ``run``, pending or under way, fails."""
        with self._cond:
            if request_id not in self._plans:
                return
            if request_id not in self._running:
                self._cancelled.add(request_id)
                self._drop(request_id)
                return
            self._aborted.add(request_id)
            plan, now = self._plans[request_id], self._current.get(request_id, (None,))[0]
            self._remove(sorted({i for c in plan.chunks for i in c.instances}),
                         lambda t: t[0] == request_id and t[1] != now)

    def busy_for(self, now: float | None = None) -> list[float]:
        """Per instance, the seconds until it has run every ticket it holds, replaying them in
        ticket order with the plans' chunk durations (``expected_end - expected_start``).

        A chunk starts when it heads the queue of each member and the request's previous
        chunk has ended; a running chunk ends its duration after it started, or now if it is
        overdue (end unknown); a chunk of a run that failed and waits for the world to be formed
        again is, like an overdue one, taken to end now. ``now``: ``time.monotonic()``.
        """
        with self._cond:
            now = time.monotonic() if now is None else now
            free = [now] * len(self._queues)
            ends: dict[Ticket, float] = {}
            for rid, (k, started) in self._current.items():
                c = self._plans[rid].chunks[k] if rid in self._plans else None
                if c is not None:
                    end = max(now, started + _duration(c))
                    ends[(rid, k)] = end
                    for i in c.instances:
                        free[i] = end
            queued = {t for q in self._queues for t in q}
            for rid, plan in self._plans.items():   # commit order: one global ticket order
                prev = now
                for k, c in enumerate(plan.chunks):
                    if (rid, k) in ends:
                        prev = ends[(rid, k)]
                        continue
                    if (rid, k) not in queued:   # done (or dropped)
                        continue
                    start = max([prev] + [free[i] for i in c.instances])
                    prev = start + _duration(c)
                    for i in c.instances:
                        free[i] = prev
            return [f - now for f in free]

    def pending(self) -> dict[int, list[Ticket]]:
        """instance -> its unfinished tickets in order (for tests and diagnostics)."""
        with self._cond:
            return {i: list(q) for i, q in enumerate(self._queues) if q}

    def commits(self) -> int:
        """Plans committed so far; a plan's ``number`` is this count right after its commit."""
        with self._cond:
            return self._commits

    def number(self, request_id: str) -> int | None:
        """The commit number of a plan not yet finished (None: not committed)."""
        with self._cond:
            return self._number.get(request_id)

    def _drop(self, request_id: str) -> None:
        self._number.pop(request_id, None)
        plan = self._plans.pop(request_id, None)
        if plan is not None:
            self._remove(sorted({i for c in plan.chunks for i in c.instances}),
                         lambda t: t[0] == request_id)

    def _remove(self, instances, match) -> None:
        for i in instances:
            before = len(self._queues[i])
            self._queues[i] = [t for t in self._queues[i] if not match(t)]
            self._progress += before - len(self._queues[i])
        self._cond.notify_all()


def _duration(chunk) -> float:
    """The chunk's compute time as planned (0 for a plan made without expected times)."""
    return max(0.0, chunk.expected_end - chunk.expected_start)
