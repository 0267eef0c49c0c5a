"""EMULATION of a KunServe decode pool: emulated engines on the wall clock, the control plane's
``KunServeController`` deciding drops and restores from their real block counts.

What runs (one process, one thread per decode unit): each unit is a
``PipelinedEmulatedEngine`` (actors/decode/kunserve_emulated.py): the engine's own batcher and
block manager, its step sleeping the simulator's iteration time (``tetris.sim.kunserve.unit_time``,
same profile: a group's pipelined round over its lookahead micro-batches), so an emulated
unit takes the simulator's time for its batch. Around them, as in the served system's P/D shape:

- the dispatcher (the arrival loop): FCFS, head never skipped, Llumnix routing to the unit
  with room and the least used share of its KV (``route``), ``reserve`` of the prompt's blocks, then ``commit_prefilled``
  after the prompt's prefill time (the prefill pool is not the bottleneck here);
- the monitor (``kunserve`` only): every ``tick_s`` each unit's KV report (``InstanceLoad``
  from its block manager) goes to ``KunServeController.decide``; a drop or restore waits for
  the iterations in flight of the units it replaces, takes their sequences (``take``) and
  gives them to the new units, held out of the batch for the KV exchange
  (``bytes (g - 1) / g`` each, queued on the old unit's links:
  ``ExchangeQueue``, the simulator's); the monitor and the regrouping
  are in ``tetris/bench/kunserve_regroup.py``.

Policies, as the simulator's: ``queue`` (blocks for the whole output promised at admission,
never preempted), ``recompute`` (the engine preempts its newest sequence when a decode finds
no block; the request goes back to the head of the dispatcher's queue with its output so far
and is prefilled again), ``swap`` (the victim's KV goes to host memory, the next iteration
waits for the PCIe copy, and it comes back before new admissions) and ``kunserve``
(recompute plus the controller). Times are multiplied by ``time_scale`` on the wall clock and
divided back in the results. A token's time is read off its unit's iteration timeline (when
the iteration ends: back-to-back iterations chain, however late the thread that runs them is
scheduled), a first token's when its prefill ends; so a loaded machine delays what the threads
do next (admissions, regrouping, the next iteration's batch), not the clock they report.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque

from tetris.actors.decode.kunserve_emulated import PipelinedEmulatedEngine
from tetris.bench.kunserve_regroup import KunServeRegrouping
from tetris.control.kunserve import KunServeController
from tetris.control.kunserve_dispatch import UnitRoom, route
from tetris.control.kunserve_memory import InstanceMemory
from tetris.sampling_params import SamplingParams
from tetris.sim.kunserve import KunRequest, PoolProfile, policy_result, unit_time

__all__ = ["EMULATED_POLICIES", "KunServeEmulation"]

EMULATED_POLICIES = ("queue", "recompute", "swap", "kunserve")


class _Unit:
    def __init__(self, engine: PipelinedEmulatedEngine) -> None:
        self.engine = engine
        self.members = engine.members
        self.step_lock = threading.Lock()     # held for a whole iteration
        self.stopped = False
        self.holding = False                  # being replaced: start no further iteration
        self.promised = 0                     # queue: blocks promised to admitted requests
        self.swapped: deque = deque()         # swap: sequences whose KV is in host memory
        self.thread: threading.Thread | None = None


class KunServeEmulation(KunServeRegrouping):
    def __init__(self, requests: list[KunRequest], mem: InstanceMemory, prof: PoolProfile,
                 policy: str, *, time_scale: float = 1.0, stall_s: float = 60.0,
                 round_model: str = "lookahead") -> None:
        if policy not in EMULATED_POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {EMULATED_POLICIES}")
        self.reqs, self.mem, self.prof, self.policy = requests, mem, prof, policy
        self.scale = time_scale
        self.round_model = round_model
        self.stall_s = stall_s          # no step and no finish for this long (wall): an error
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.control = (KunServeController(mem, list(range(prof.instances)))
                        if policy == "kunserve" else None)
        self.engines: list[PipelinedEmulatedEngine] = []     # every unit's, replaced ones too
        self.units = [self._unit((i,), mem.kv_blocks) for i in range(prof.instances)]
        self.waiting: deque[KunRequest] = deque()
        self.unit_of: dict[int, _Unit] = {}
        self.seq_of: dict[int, object] = {}
        self.need: dict[int, int] = {}
        self.generated: dict[int, list[int]] = {}     # output of a preempted request
        self.preemptions = 0
        self.preempted_at: list[float] = []
        self.regroup_log: list[tuple[float, float]] = []    # (decided, landed), trace s
        self.regroup_iterations = 0    # most iterations a replaced unit ran after a decision
        self.prefills: list[tuple[float, int]] = []
        self.done = 0
        self.exchange_bytes = 0.0
        self.dropped_layers_log: list[tuple[float, dict[int, int]]] = []
        self.group_blocks_seen: dict[tuple[int, ...], int] = {}
        self.t0 = 0.0
        self.closing = False

    @property
    def controller(self) -> KunServeController | None:
        return self.control

    # -- time ---------------------------------------------------------------------------------
    def now(self) -> float:
        """Trace seconds since the start (wall clock / time scale)."""
        return (time.monotonic() - self.t0) / self.scale

    def _unit(self, members: tuple[int, ...], blocks: int,
              layers: tuple[int, ...] | None = None) -> _Unit:
        """A unit whose members hold ``layers`` (all of them: one instance)."""
        p, rm = self.prof, self.round_model
        layers = layers or (self.mem.num_layers,)
        engine = PipelinedEmulatedEngine(
            members, num_blocks=blocks, block_size=self.mem.block_size, max_batch=p.max_batch,
            step_model=lambda contexts: unit_time(self.mem, p, layers, contexts, rm),
            prefill_s_per_token=p.prefill_s_per_token, time_scale=self.scale, lock=self.lock)
        self.engines.append(engine)
        return _Unit(engine)

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> dict:
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self._prefill_loop, daemon=True)]
        if self.control is not None:
            threads.append(threading.Thread(target=self._monitor_loop, daemon=True))
        for u in self.units:
            self._start(u)
        for t in threads:
            t.start()
        for r in self.reqs:
            wait = r.arrival * self.scale - (time.monotonic() - self.t0)
            if wait > 0:
                time.sleep(wait)
            with self.lock:
                self.waiting.append(r)
                self._admit()
        with self.lock:
            progress, since = -1, time.monotonic()
            while self.done < len(self.reqs):
                self.cv.wait(timeout=1.0)
                now_progress = self.done + sum(u.engine.steps for u in self.units)
                if now_progress != progress:
                    progress, since = now_progress, time.monotonic()
                elif time.monotonic() - since > self.stall_s:
                    self.closing = True
                    for u in self.units:
                        u.stopped = True
                    self.cv.notify_all()
                    raise RuntimeError(f"EMULATION stalled for {self.stall_s:g} s: "
                                       f"{self._state()}")
            self.closing = True
            for u in self.units:
                u.stopped = True
            self.cv.notify_all()
        for t in threads + [u.thread for u in self.units]:
            t.join()
        return self._result()

    def _state(self) -> str:
        """What is left, for a stall's error: the queue and each unit's sequences."""
        left = [r.rid for r in self.reqs if math.isnan(r.finish)]
        units = [f"{u.members}: seqs {len(u.engine._seqs)} running {len(u.engine.batcher.running)} "
                 f"ready {len(u.engine.batcher.ready)} waiting {len(u.engine.batcher.waiting)} "
                 f"held {len(u.engine.held)} free {u.engine.blocks.num_free_blocks}"
                 f"/{u.engine.blocks.num_blocks}" for u in self.units]
        statuses = sorted({str(getattr(self.seq_of.get(i), "status", None)) for i in left})
        return (f"{len(left)} unfinished (first {left[:5]}, statuses {statuses}), "
                f"{len(self.waiting)} queued, {len(self.prefills)} in prefill; " + "; ".join(units))

    def _start(self, u: _Unit) -> None:
        u.thread = threading.Thread(target=self._unit_loop, args=(u,), daemon=True)
        u.thread.start()

    def _unit_loop(self, u: _Unit) -> None:
        e = u.engine
        while True:
            with self.lock:
                if u.stopped:
                    return
                nxt = e.release_held(self.now())
                self._swap_in(u)
                if u.holding or not self._runnable(e):
                    timeout = 0.05 if nxt is None else max(0.0, nxt - self.now()) * self.scale
                    self.cv.wait(timeout=timeout)
                    e.continuing = False
                    continue
            with u.step_lock, self.lock:
                if u.stopped:
                    return
                if u.holding:
                    continue
                ran = e.steps
                outputs = e.step()     # releases self.lock while the iteration sleeps
                e.continuing = e.steps > ran     # an empty plan ran nothing: not back to back
                now = (e.step_end - self.t0) / self.scale    # the iteration's end, trace time
                for out in outputs:
                    if out.finished:
                        self._finish(int(out.request_id), now)
                self._requeue_preempted(e)
                self._admit()

    def _requeue_preempted(self, e: PipelinedEmulatedEngine) -> None:
        """The engine's preempted sequences (its batcher's waiting) go back to the head of
        the dispatcher's queue with their output so far: re-reserved on any unit and
        prefilled again in the prefill pool (the simulator's ``recompute``), not on this unit."""
        victims = list(e.batcher.waiting)
        if self.policy == "swap":
            self._swap_out(e, victims)
            return
        for seq in victims:
            e.batcher.remove(seq)
            del e._seqs[seq.request_id]
            self.generated[int(seq.request_id)] = list(seq.output_token_ids)
            self.preemptions += 1
            self.preempted_at.append(self.now())
        self.waiting.extendleft(self.reqs[int(s.request_id)] for s in reversed(victims))

    def _swap_out(self, e: PipelinedEmulatedEngine, victims: list) -> None:
        """``swap``: a victim's KV goes to host memory (its blocks were freed by the
        preemption; its KV is kept, so nothing is recomputed) and the next iteration waits
        for the copy over PCIe (the simulator's ``pending_s``)."""
        u = next(x for x in self.units if x.engine is e)
        for seq in victims:
            e.batcher.waiting.remove(seq)
            seq.num_computed = seq.num_tokens - 1
            e.pending_s += (e.blocks.blocks_needed(seq.num_tokens) * self.mem.block_bytes
                            / self.prof.pcie_bytes_per_s)
            u.swapped.appendleft(seq)
            self.preemptions += 1
            self.preempted_at.append(self.now())

    def _swap_in(self, u: _Unit) -> None:
        """Swapped sequences come back (before any new admission) once their blocks fit."""
        e = u.engine
        while u.swapped and e.blocks.can_allocate(u.swapped[0].num_tokens + 1):
            seq = u.swapped.popleft()
            e.blocks.allocate(seq)
            e.batcher.add_prefilled(seq)
            e.pending_s += len(seq.block_table) * self.mem.block_bytes / self.prof.pcie_bytes_per_s

    @staticmethod
    def _runnable(e: PipelinedEmulatedEngine) -> bool:
        """Something to step: running or ready sequences, or a preempted one that fits now
        (blocks still reserved for prompts in prefill can keep it out until they commit)."""
        b = e.batcher
        return bool(b.running or b.ready
                    or (b.waiting and e.blocks.can_allocate(b.waiting[0].num_tokens + 1)))

    def _finish(self, rid: int, now: float) -> None:
        r = self.reqs[rid]
        if not math.isnan(r.finish):
            return
        r.finish = now
        self.unit_of[rid].promised -= self.need.get(rid, 0)
        self.done += 1
        self.cv.notify_all()

    def _prefill_loop(self) -> None:
        """The prefill pool: each reserved prompt's KV is in place after its prefill time."""
        with self.lock:
            while not self.closing:
                now = self.now()
                while self.prefills and self.prefills[0][0] <= now:
                    ready, rid = heapq.heappop(self.prefills)
                    self._commit(rid, ready)     # the prefill's end, however late noticed
                nxt = self.prefills[0][0] if self.prefills else now + 0.05
                self.cv.wait(timeout=max(0.0, nxt - now) * self.scale)

    def _commit(self, rid: int, now: float) -> None:
        r, u = self.reqs[rid], self.unit_of[rid]
        u.engine.commit_prefilled(str(rid), u.engine.vocab_size - 1)
        if math.isnan(r.first_token):
            r.first_token = now      # the prefill samples the first token
        if str(rid) not in u.engine._seqs:     # one-token output: done at the prefill
            self._finish(rid, now)
            self._admit()
        self.cv.notify_all()

    # -- the dispatcher -------------------------------------------------------------------------
    def _free(self, u: _Unit) -> int:
        if self.policy == "queue":
            return u.engine.blocks.num_blocks - u.promised
        return u.engine.blocks.num_free_blocks

    def _admit(self) -> None:
        """FCFS with the head never skipped, to the open unit with room and the least used
        share of its KV (``route``, the simulator's); a unit whose own preempted sequences
        wait is closed until they are back."""
        bs = self.mem.block_size
        for u in self.units:
            self._swap_in(u)
        while self.waiting:
            r = self.waiting[0]
            open_units = [u for u in self.units if not u.stopped and not u.engine.batcher.waiting
                          and not u.swapped
                          and len(u.engine._seqs) < self.prof.max_batch * len(u.members)]
            if not open_units:
                return
            generated = self.generated.get(r.rid, [])
            tokens = (r.prompt + r.output if self.policy == "queue"
                      else r.prompt + len(generated) + 1)
            need = -(-tokens // bs)
            pick = route(need, [UnitRoom(x.members[0], x.engine.blocks.num_blocks - self._free(x),
                                         self._free(x)) for x in open_units])
            if pick is None:
                return
            u = open_units[pick]
            self.waiting.popleft()
            if len(u.members) == 1 and r.home < 0:
                r.home = u.members[0]
            params = SamplingParams(max_tokens=r.output, ignore_eos=True)
            u.engine.reserve(str(r.rid), [1] * r.prompt, params, self.generated.pop(r.rid, ()))
            self.seq_of[r.rid] = u.engine._seqs[str(r.rid)]
            self.unit_of[r.rid] = u
            if self.policy == "queue":
                self.need[r.rid] = need
                u.promised += need
            prefill_s = (r.prompt + len(generated)) * self.prof.prefill_s_per_token
            heapq.heappush(self.prefills, (self.now() + prefill_s, r.rid))
            self.cv.notify_all()

    # -- operator surface ----------------------------------------------------------------------
    def unit_blocks(self) -> dict[int, int]:
        """KV blocks of each serving unit, by leader (``tetris:kunserve_kv_capacity_blocks``)."""
        with self.lock:
            return {u.members[0]: u.engine.blocks.num_blocks for u in self.units}

    def close(self) -> None:
        """Stop the unit threads of a driver that was not ``run`` (admin-route use)."""
        with self.lock:
            self.closing = True
            for u in self.units:
                u.stopped = True
            self.cv.notify_all()
        for u in self.units:
            if u.thread is not None:
                u.thread.join()

    # -- results ------------------------------------------------------------------------------
    def _result(self) -> dict:
        return {"mode": "EMULATION", **policy_result(
            self.policy, self.reqs, self.preemptions, self.control, self.exchange_bytes,
            [d for d, _ in self.regroup_log], self.preempted_at),
            "regroup_landed_s": [round(t, 3) for _, t in self.regroup_log],
            "max_lag_s": max(e.max_lag for e in self.engines) / self.scale,
            "regroup_iterations": self.regroup_iterations}
