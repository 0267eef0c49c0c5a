"""The control plane: every decision about a request, on the caller's clock.

One object, two drivers. The live dispatcher (``tetris.serve.dispatcher``) drives it from
asyncio with the monotonic clock and remote pools; the simulator (``tetris.sim.cluster``)
drives it from its event loop with simulated time. Both call the same methods in the same
order, so the simulator predicts the decisions of the live system:

1. ``route(run_id, kv_tokens)``: choose a decode instance (Llumnix freeness) and count the
   request's KV tokens there as virtual usage;
2. ``plan(run_id, prompt_tokens, now)``: θ from the rate monitor (an arrival), then the
   policy's plan against the queue's snapshot; nothing is booked yet;
3. ``commit(plan)``: book the plan in the queue (paper Eq. 2);
   ``admit`` is 1-3 in one call, for a driver with nothing to do between them;
4. ``pool_report(busy_for, now)`` / ``decode_report(instance, free_slots, batch)``: what the
   pools say of their load;
5. ``prefill_done(run_id, now)``: the run's prefill ended, its bookings go;
6. ``kv_arrived(run_id)``: the decode instance holds the KV, the virtual usage goes;
7. ``finished(run_id, now)``: completion, abort or failure; frees whatever is still held
   (idempotent, so every exit path may call it).

Pure: no Ray, no torch, no asyncio, no wall clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from tetris.control.queue import PrefillQueue
from tetris.plan import PrefillPlan
from tetris.scheduler.rate import RateMonitor
from tetris.scheduler.router import DecodeRouter

__all__ = ["Admission", "ControlPlane"]


class Admission(msgspec.Struct, frozen=True):
    """One run's decisions: its decode instance and its committed prefill plan."""

    decode_instance: int
    plan: PrefillPlan


class ControlPlane:
    """The policy, the prefill queue, the decode router and θ, with one method per event.

    ``policy`` has ``plan(request_id, prompt_tokens, now, pool_state, improvement_rate=θ)``;
    ``router`` is None for a prefill-only driver (the improvement-rate profiler).
    """

    def __init__(self, policy: Any, queue: PrefillQueue, router: DecodeRouter | None, *,
                 improvement_rate: float | None, monitor: RateMonitor | None = None) -> None:
        self.policy = policy
        self.queue = queue
        self.router = router
        self.monitor = monitor
        self.improvement_rate = (monitor.improvement_rate if monitor is not None
                                 else improvement_rate)
        self._virtual: dict[str, tuple[int, int]] = {}   # run -> (decode instance, kv tokens)

    # -- decisions --------------------------------------------------------------------------
    def route(self, run_id: str, kv_tokens: int,
              avoid: frozenset[int] | set[int] = frozenset()) -> int:
        """The decode instance for a run, its KV tokens booked there as virtual usage.
        Raises ``NoInstanceUp`` when every instance is down."""
        if self.router is None:
            raise RuntimeError("this control plane has no decode router")
        if run_id in self._virtual:
            raise ValueError(f"run {run_id!r} is already routed")
        instance = self.router.choose(kv_tokens, avoid)
        self.router.reserve(instance, kv_tokens)
        self._virtual[run_id] = (instance, kv_tokens)
        return instance

    def plan(self, run_id: str, prompt_tokens: int, now: float, *,
             arrival: bool = True) -> PrefillPlan:
        """The policy's plan against the queue now; ``arrival`` runs θ's update first (a run
        again after a lost instance is not an arrival)."""
        if arrival:
            self._update_theta(now)
        return self.policy.plan(run_id, prompt_tokens, now, self.queue.pool_state(now),
                                improvement_rate=self.improvement_rate)

    def commit(self, plan: PrefillPlan) -> None:
        self.queue.commit(plan)

    def admit(self, run_id: str, prompt_tokens: int, kv_tokens: int, now: float) -> Admission:
        """Route, plan and commit one arriving request."""
        instance = self.route(run_id, kv_tokens)
        plan = self.plan(run_id, prompt_tokens, now)
        self.commit(plan)
        return Admission(instance, plan)

    # -- reports ----------------------------------------------------------------------------
    def pool_report(self, busy_for: Sequence[float], now: float) -> None:
        self.queue.observe(busy_for, now)

    def decode_report(self, instance: int, free_slots: int, batch_size: int) -> None:
        if self.router is not None:
            self.router.update(instance, free_slots, batch_size)

    def set_decode_up(self, instance: int, up: bool) -> None:
        if self.router is not None:
            self.router.set_up(instance, up)

    # -- a run's progress -------------------------------------------------------------------
    def prefill_done(self, run_id: str, now: float) -> None:
        self.queue.finish(run_id, now)

    def kv_arrived(self, run_id: str) -> None:
        entry = self._virtual.pop(run_id, None)
        if entry is not None and self.router is not None:
            self.router.release(*entry)

    def finished(self, run_id: str, now: float) -> None:
        """The run is over, whatever its outcome: free its bookings and virtual usage."""
        self.prefill_done(run_id, now)
        self.kv_arrived(run_id)

    # -- θ ----------------------------------------------------------------------------------
    def _update_theta(self, now: float) -> None:
        if self.monitor is None:
            return
        self.monitor.observe_arrival(now)
        theta = self.monitor.maybe_update(now)
        if theta is not None:
            self.improvement_rate = theta

    def held(self) -> dict[str, int]:
        """What the control plane still holds (zero everywhere when idle)."""
        return {"queue_bookings": self.queue.bookings(),
                "virtual_usage": sum(self.router.virtual) if self.router is not None else 0,
                "virtual_requests": len(self._virtual)}
