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

With a ``PrefixIndex`` (prefix caching, docs/prefix_cache.md), ``plan`` and ``admit`` take the
prompt's block hashes: a cached prefix is planned as history (``plan_from_prefix``) and its
blocks referenced until ``finished``. ``commit`` indexes the run's new blocks where its KV will lie
(its plan's last group): a later run may plan from them at once, and runs after it on those
instances (commit order, Eq. 2's queue). ``prefix_cached(run_id)`` after a successful prefill
moves the run's blocks to it and drops its own reference; a run that ends without it is
forgotten by the index (``finished``); ``prefix_released()`` names the runs whose cached KV nothing needs any more.

Pure: no Ray, no torch, no asyncio, no wall clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from tetris.control.prefix_index import KvLocation, PrefixIndex
from tetris.control.queue import PrefillQueue
from tetris.plan import PrefillPlan
from tetris.scheduler.prefix_move import PrefixMove
from tetris.scheduler.prefix_plan import PrefixOption, plan_from_prefix
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
                 improvement_rate: float | None, monitor: RateMonitor | None = None,
                 prefix_index: PrefixIndex | None = None, prefix_placement: str = "auto",
                 prefix_move: PrefixMove | None = None) -> None:
        self.policy = policy
        self.queue = queue
        self.router = router
        self.monitor = monitor
        self.improvement_rate = (monitor.improvement_rate if monitor is not None
                                 else improvement_rate)
        self._virtual: dict[str, tuple[int, int]] = {}   # run -> (decode instance, kv tokens)
        self.prefix_index = prefix_index
        # run -> (its prompt's block hashes, its plan's last group, its decode instance)
        self._prefix_runs: dict[str, tuple[Sequence[int], tuple[int, ...], int | None]] = {}
        self.last_prefix: PrefixOption | None = None
        self._prefix_cached: set[str] = set()   # runs whose prefill succeeded
        # [prefix_cache] placement, and the link model a hit's "move" option is priced on
        # (None: not offered); tetris/scheduler/prefix_plan.py
        self.prefix_placement = prefix_placement
        self.prefix_move = prefix_move

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

    def book_shared(self, run_id: str, shared_tokens: int) -> None:
        """``shared_tokens`` of a routed run's booked slots are held on its instance already
        (a prefix shared with a run kept there, whose blocks the instance reports as used):
        its virtual usage drops by them."""
        instance, booked = self._virtual[run_id]
        if not 0 <= shared_tokens <= booked:
            raise ValueError(f"run {run_id!r} booked {booked} slots, {shared_tokens} cannot "
                             "be shared")
        self.router.release(instance, shared_tokens)
        self._virtual[run_id] = (instance, booked - shared_tokens)

    def plan(self, run_id: str, prompt_tokens: int, now: float, *,
             arrival: bool = True, block_hashes: Sequence[int] | None = None) -> PrefillPlan:
        """The policy's plan against the queue now; ``arrival`` runs θ's update first (a run
        again after a lost instance is not an arrival). With a prefix index and the prompt's
        ``block_hashes``, a cached prefix is planned as history and referenced."""
        if arrival:
            self._update_theta(now)
        if self.prefix_index is None or block_hashes is None:
            return self.policy.plan(run_id, prompt_tokens, now, self.queue.pool_state(now),
                                    improvement_rate=self.improvement_rate)
        return self._plan_with_prefix(run_id, prompt_tokens, now, block_hashes)

    def _plan_with_prefix(self, run_id: str, prompt_tokens: int, now: float,
                          block_hashes: Sequence[int]) -> PrefillPlan:
        index = self.prefix_index
        index.release(run_id)   # a run planned again drops its earlier reference
        hit = index.match(block_hashes)
        option = plan_from_prefix(self.policy, run_id, prompt_tokens, now,
                                  self.queue.pool_state(now), cached_tokens=hit.tokens,
                                  holders=hit.location.prefill_instances, source=hit.source,
                                  improvement_rate=self.improvement_rate,
                                  placement=self.prefix_placement, move=self.prefix_move,
                                  source_ready=self._prefix_ready(hit.source))
        if option.plan.cached_tokens:
            index.acquire(run_id, hit)
        self.last_prefix = option
        decode = self._virtual[run_id][0] if run_id in self._virtual else None
        self._prefix_runs[run_id] = (block_hashes, option.plan.instances, decode)
        return option.plan

    def commit(self, plan: PrefillPlan) -> None:
        self.queue.commit(plan)
        entry = self._prefix_runs.get(plan.request_id)
        if self.prefix_index is not None and entry is not None:
            # Readable from now on: a run planned from it starts after it on its instances.
            # Blocks cached already stay with their source, whose KV is there now or sooner.
            self.prefix_index.insert(plan.request_id, entry[0],
                                     KvLocation(plan.instances, entry[2]), rebind=False)

    def admit(self, run_id: str, prompt_tokens: int, kv_tokens: int, now: float, *,
              block_hashes: Sequence[int] | None = None) -> Admission:
        """Route, plan and commit one arriving request."""
        instance = self.route(run_id, kv_tokens)
        plan = (self.plan(run_id, prompt_tokens, now) if block_hashes is None
                else self.plan(run_id, prompt_tokens, now, block_hashes=block_hashes))
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
        if self.prefix_index is not None:
            self.prefix_index.release(run_id)
            if self._prefix_runs.pop(run_id, None) is not None \
                    and run_id not in self._prefix_cached:
                self.prefix_index.forget(run_id)   # committed, never prefilled: no KV to read
            self._prefix_cached.discard(run_id)

    # -- prefix caching ---------------------------------------------------------------------
    def prefix_cached(self, run_id: str) -> int:
        """The run's prefill succeeded: its blocks are the most recently used (indexed at
        commit, where its KV lies: its plan's last group; its decode instance). Returns the
        blocks indexed."""
        entry = self._prefix_runs.get(run_id)
        if self.prefix_index is None or entry is None:
            return 0
        hashes, instances, decode = entry
        self._prefix_cached.add(run_id)
        # Its KV is the newest copy of its whole prompt: its blocks move to it, older sources
        # may go.
        n = self.prefix_index.insert(run_id, hashes, KvLocation(instances, decode))
        # Its own KV now holds the prefix it read: the source it planned from may go.
        self.prefix_index.release(run_id)
        return n

    def _prefix_ready(self, source: str) -> bool:
        """Whether ``source``'s KV is all computed (its prefill succeeded): a run indexed at
        commit and not prefilled yet is still running; one gone from ``_prefix_runs`` while
        still in the index had finished its prefill (else ``finished`` forgot it)."""
        return source in self._prefix_cached or source not in self._prefix_runs

    def prefix_released(self) -> list[str]:
        """Runs whose cached KV no block and no run needs any more (free it where it lies)."""
        return self.prefix_index.drain_released() if self.prefix_index is not None else []

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
                "virtual_requests": len(self._virtual),
                **({"prefix_refs": self.prefix_index.stats()["held_runs"]}
                   if self.prefix_index is not None else {})}
