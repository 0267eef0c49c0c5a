"""SIMULATION of decode KV-memory overload: KunServe and the KV-centric baselines.

The served system's shape (P/D disaggregation): a request arrives, is routed Llumnix-style to
the decode unit with room and the least used share of its KV
(``tetris/control/kunserve_dispatch.py``), and starts its prefill only once that unit has
reserved its KV blocks (the dispatcher's ``decode.reserve``); the prefill pool is not the
bottleneck here (``prompt * prefill_s_per_token`` plus the KV stream), so the time a request
waits for decode KV memory is TTFT. Decode units run iterations of every request whose KV is
in place. Policies when blocks run out:

- ``queue``: Tetris today: blocks for the prompt plus the whole output are reserved up front
  and never preempted; the rest wait (the live system's 429 and retry).
- ``recompute`` (vLLM): blocks grow with the output; a decode that finds no block preempts the
  newest running request, which later reserves again and is prefilled again.
- ``swap`` (InferCept-style): the newest request's KV goes to host memory over PCIe, stalling
  the iteration, and comes back before new admissions.
- ``kunserve``: ``recompute``'s paged growth plus the control plane's ``KunServeController``
  every ``tick_s``: a drop merges units into pipelined groups whose freed parameter memory is
  KV (running requests stall for the KV exchange, ``T_ex = bytes (g-1)/g / link``), a restore
  splits them back (the exchange back stalls them again; parameter pulls overlap).

Iteration time of one instance (memory-bound decode): ``T(b, ctx) = params/hbm + b * per_seq
+ ctx * kv_tok/hbm``. A group runs its batch as micro-batches formed by lookahead (§4.3,
balanced by predicted cost) through its members' layer ranges with an activation hop between
members; its iteration is the pipeline's steady round, bubbles included, computed from those
micro-batches (``tetris/sim/kunserve_pipeline.py``; the paper's 8.3% bubble share is a
measurement to compare with, not an input).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

import msgspec

from tetris.control.kunserve import KunServeController
from tetris.control.kunserve_dispatch import UnitRoom, route
from tetris.control.kunserve_memory import InstanceLoad, InstanceMemory
from tetris.sim.kunserve_exchange import ExchangeQueue
from tetris.sim.kunserve_pipeline import group_round
from tetris.sim.kunserve_result import policy_result

__all__ = ["POLICIES", "ROUND_MODELS", "KunRequest", "KunServeSim", "PoolProfile",
           "iteration_time", "policy_result", "unit_time"]

POLICIES = ("queue", "recompute", "swap", "kunserve")


class PoolProfile(msgspec.Struct, frozen=True):
    """Timing of one instance (configs/profiles/kunserve-*.json)."""

    name: str
    instances: int
    hbm_bytes_per_s: float
    per_seq_s: float                 # per running sequence per decode iteration
    prefill_s_per_token: float
    link_bytes_per_s: float          # between instances (KV exchange, activations)
    pcie_bytes_per_s: float          # swap to host
    activation_bytes_per_token: int
    bubble: float = 0.083            # KunServe §6.4's measured share, for comparison only:
                                     # the model computes its own (unit_time)
    max_batch: int = 256
    tick_s: float = 0.5              # the artifact's load-report interval


def iteration_time(m: InstanceMemory, p: PoolProfile, g: int, b: int, ctx: int) -> float:
    """One decode iteration of a unit of ``g`` members over ``b`` sequences holding ``ctx``
    tokens (the module docstring's formulas); the EMULATION's emulated engines sleep it too."""
    kv_tok = m.block_bytes / m.block_size

    def t(bb, cc):
        return m.param_bytes / p.hbm_bytes_per_s + bb * p.per_seq_s \
            + cc * kv_tok / p.hbm_bytes_per_s
    if g == 1:
        return t(b, ctx)
    act = b / g * p.activation_bytes_per_token / p.link_bytes_per_s
    return t(b / g, ctx / g) * (1 + p.bubble) + g * act


ROUND_MODELS = ("lookahead", "token_budget", "fixed")


def unit_time(m: InstanceMemory, p: PoolProfile, layers: Sequence[int],
              contexts: Sequence[int], round_model: str = "lookahead") -> float:
    """One decode iteration of a unit whose members hold ``layers`` over sequences holding
    ``contexts`` tokens: ``T(b, ctx)`` for one instance; for a group the pipelined round over
    its lookahead micro-batches (``round_model`` "lookahead"), over token-budget ones
    ("token_budget", the vLLM-PP baseline), or the earlier closed form with the paper's
    bubble share as an input ("fixed", ``iteration_time``). The EMULATION's emulated engines
    sleep it too."""
    if len(layers) == 1 or round_model == "fixed":
        return iteration_time(m, p, len(layers), len(contexts), sum(contexts))
    if round_model not in ROUND_MODELS:
        raise ValueError(f"round model {round_model!r} is not one of {ROUND_MODELS}")
    return group_round(m, p, layers, contexts, balanced=round_model == "lookahead").seconds


class KunRequest:
    __slots__ = (
        "arrival",
        "blocks",
        "finish",
        "first_token",
        "generated",
        "home",
        "output",
        "prefill_end",
        "prompt",
        "rid",
        "stalled_until",
        "unit",
    )

    def __init__(self, rid: int, arrival: float, prompt: int, output: int) -> None:
        self.rid, self.arrival, self.prompt, self.output = rid, arrival, prompt, output
        self.generated = 0
        self.blocks = 0
        self.first_token = math.nan
        self.finish = math.nan
        self.stalled_until = 0.0
        self.prefill_end = 0.0     # when its latest prefill's KV is in place
        self.home = -1
        self.unit = None           # the unit holding its KV, None while queued or swapped

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


class _Unit:
    """An instance, or a group of instances run as one pipeline."""

    def __init__(self, members: tuple[int, ...], capacity: int,
                 layers: tuple[int, ...]) -> None:
        self.members = members
        self.capacity = capacity
        self.layers = layers       # layers each member holds (the pipeline's stages)
        self.used = 0
        self.running: list[KunRequest] = []
        self.swapped: deque[KunRequest] = deque()
        self.busy = False
        self.alive = True
        self.step_end = 0.0
        self.epoch = 0
        self.pending_s = 0.0       # swap traffic the next iteration waits for


class KunServeSim:
    def __init__(self, requests: list[KunRequest], mem: InstanceMemory, prof: PoolProfile,
                 policy: str, *, round_model: str = "lookahead") -> None:
        if policy not in POLICIES or round_model not in ROUND_MODELS:
            raise ValueError(f"policy {policy!r} / round model {round_model!r} is not one of "
                             f"{POLICIES} / {ROUND_MODELS}")
        self.reqs, self.mem, self.prof, self.policy = requests, mem, prof, policy
        self.round_model = round_model
        self.bs = mem.block_size
        self.units = [_Unit((i,), mem.kv_blocks, (mem.num_layers,))
                      for i in range(prof.instances)]
        self.control = (KunServeController(mem, list(range(prof.instances)))
                        if policy == "kunserve" else None)
        self.events: list = []
        self._seq = 0
        self.exchange_bytes = 0
        self.waiting: deque[KunRequest] = deque()   # the dispatcher's queue, FCFS
        self.preemptions = 0
        self.preempted_at: list[float] = []
        self.kv_capacity_log: list[tuple[float, int]] = []

    # -- events -----------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self.events, (t, kind, self._seq, payload))
        self._seq += 1

    def run(self) -> dict:
        for r in self.reqs:
            self._push(r.arrival, 1, r)
        if self.control is not None:
            self._push(self.reqs[0].arrival, 2, None)
        last_arrival = self.reqs[-1].arrival
        while self.events:
            now, kind, _, payload = heapq.heappop(self.events)
            if kind == 0:
                self._step_end(now, payload)
            elif kind == 1:
                self._arrive(now, payload)
            elif now <= last_arrival or self.waiting or any(u.running for u in self.units):
                self._tick(now)
                self._push(now + self.prof.tick_s, 2, None)
        return self._result()

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def _arrive(self, now: float, r: KunRequest) -> None:
        self.waiting.append(r)
        self._admit(now)

    def _need(self, r: KunRequest) -> int:
        if self.policy == "queue":
            return self._blocks(r.prompt + r.output)
        return self._blocks(r.tokens + 1)

    def _kick(self, now: float, unit: _Unit) -> None:
        if not unit.busy and unit.alive:
            self._start(now, unit)

    def _admit(self, now: float) -> None:
        """Reserve blocks for queued requests, FCFS with the head never skipped, on the unit
        with room and the least used share of its KV (``route``: Llumnix balance across
        units of different sizes); each is prefilled (again, after a preemption) and joins
        that unit's batch once its KV is in place."""
        for u in self.units:
            self._swap_in(u)
        while self.waiting:
            r = self.waiting[0]
            open_units = [u for u in self.units
                          if not u.swapped and len(u.running) < self.prof.max_batch * len(u.members)]
            if not open_units:
                return
            need = self._need(r)
            pick = route(need, [UnitRoom(x.members[0], x.used, x.capacity - x.used)
                                for x in open_units])
            if pick is None:
                return
            u = open_units[pick]
            self.waiting.popleft()
            if len(u.members) == 1 and r.home < 0:
                r.home = u.members[0]
            r.blocks = need
            u.used += need
            u.running.append(r)
            r.unit = u
            ready = now + r.tokens * self.prof.prefill_s_per_token
            r.stalled_until = r.prefill_end = ready
            if math.isnan(r.first_token):
                r.first_token = ready     # the prefill samples the first token
                r.generated = 1
                if r.generated >= r.output:
                    self._finish(u, r, ready)
            self._kick(now, u)

    def _swap_in(self, u: _Unit) -> None:
        while u.swapped and u.capacity - u.used >= self._blocks(u.swapped[0].tokens + 1):
            r = u.swapped.popleft()
            r.blocks = self._blocks(r.tokens)
            u.used += r.blocks
            u.running.append(r)
            r.unit = u
            u.pending_s += r.blocks * self.mem.block_bytes / self.prof.pcie_bytes_per_s

    # -- one iteration ----------------------------------------------------------------------
    def _start(self, now: float, u: _Unit) -> None:
        self._grow(now, u)
        batch = [r for r in u.running if r.stalled_until <= now]
        u.epoch += 1
        if not batch:
            stalled = [r.stalled_until for r in u.running]
            u.busy = bool(stalled)
            if stalled:      # wake when the first request's KV is in place
                self._push(min(stalled), 0, (u, None, u.epoch))
            return
        dur = unit_time(self.mem, self.prof, u.layers, [r.tokens for r in batch],
                        self.round_model) + u.pending_s
        u.pending_s = 0.0
        u.busy, u.step_end = True, now + dur
        self._push(now + dur, 0, (u, batch, u.epoch))

    def _grow(self, now: float, u: _Unit) -> None:
        """Decodes whose next token opens a block take one; preempt the newest when none."""
        if self.policy == "queue":
            return
        i = 0
        while i < len(u.running):
            r = u.running[i]
            if r.stalled_until > now or self._blocks(r.tokens + 1) <= r.blocks:
                i += 1
                continue
            if u.used < u.capacity:
                r.blocks += 1
                u.used += 1
                i += 1
                continue
            victim = u.running.pop()
            victim.unit = None
            u.used -= victim.blocks
            self.preemptions += 1
            self.preempted_at.append(now)
            if self.policy == "swap":
                u.pending_s += victim.blocks * self.mem.block_bytes / self.prof.pcie_bytes_per_s
                u.swapped.appendleft(victim)
            else:
                self.waiting.appendleft(victim)
            victim.blocks = 0

    def _finish(self, u: _Unit, r: KunRequest, t: float) -> None:
        r.finish = t
        u.running.remove(r)
        u.used -= r.blocks
        r.blocks = 0
        r.unit = None

    def _step_end(self, now: float, payload) -> None:
        u, batch, epoch = payload
        if batch is not None:
            for r in batch:
                if r.blocks and r.unit is not None:   # still running (not preempted meanwhile)
                    r.generated += 1
                    if r.generated >= r.output:
                        self._finish(r.unit, r, now)
        if epoch != u.epoch or not u.alive:
            return
        u.busy = False
        self._admit(now)
        self._kick(now, u)

    # -- KunServe ---------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        if self.control is None:
            return
        loads = {}
        queued = sum(self._need(r) for r in self.waiting)
        total = sum(u.capacity for u in self.units)
        for u in self.units:    # the dispatcher's queue, shared out by capacity
            growth = sum(1 for r in u.running if self._blocks(r.tokens + 1) > r.blocks)
            loads[u.members[0]] = InstanceLoad(u.capacity, u.used, growth,
                                               queued * u.capacity // total)
        # the queue is FIFO with its head never skipped: a head no unit could take even empty
        # waits for a merge (the served pool ticks with a refused reservation's blocks)
        head = self._need(self.waiting[0]) if self.waiting else 0
        decision = self.control.decide(loads, fit_blocks=head)
        if decision is None:
            return
        self._regroup(now, [g.members for g in self.control.groups])

    def _regroup(self, now: float, member_sets: list[tuple[int, ...]]) -> None:
        by_members = {u.members: u for u in self.units}
        fresh = []
        for members in member_sets:
            if members not in by_members:
                held = tuple(e - s for s, e in self.control.group_of(members[0]).layer_ranges)
                fresh.append(_Unit(members, self.mem.group_kv_blocks(held)
                                   if len(members) > 1 else self.mem.kv_blocks, held))
        kept = [by_members[m] for m in member_sets if m in by_members]
        old = [u for u in self.units if u.members not in member_sets]
        for u in old:
            u.alive = False
        self._place(now, old, fresh)
        self.units = sorted(kept + fresh, key=lambda u: u.members[0])
        self.kv_capacity_log.append((now, sum(u.capacity for u in self.units)))
        self._admit(now)
        for u in fresh:
            self._kick(now, u)

    def _place(self, now: float, old: list[_Unit], fresh: list[_Unit]) -> None:
        """Old units' requests go to the new units holding their home instance (or the one
        with most room); running ones stall for the KV exchange (``bytes * (g - 1) / g``
        each, queued behind the old unit's earlier requests on its links: ``ExchangeQueue``),
        and at least until the old unit's iteration in flight ends."""
        def target(r):
            homes = [u for u in fresh if r.home in u.members]
            if homes and homes[0].capacity - homes[0].used >= r.blocks:
                return homes[0]
            return max(fresh, key=lambda x: (x.capacity - x.used, -x.members[0]))
        for o in old:
            g = max(len(o.members), *(len(u.members) for u in fresh))
            links = ExchangeQueue(now, len(o.members), self.prof.link_bytes_per_s)
            for r in o.running:
                u = target(r)
                if r.prefill_end <= now:     # in prefill, its KV streams to the new unit
                    nbytes = r.blocks * self.mem.block_bytes * (g - 1) / g
                    self.exchange_bytes += nbytes
                    r.stalled_until = max(links.send(nbytes), o.step_end)
                u.running.append(r)
                r.unit = u
                u.used += r.blocks
            for r in o.swapped:
                target(r).swapped.append(r)

    # -- results ----------------------------------------------------------------------------
    def _result(self) -> dict:
        return policy_result(self.policy, self.reqs, self.preemptions, self.control,
                             self.exchange_bytes, [t for t, _ in self.kv_capacity_log],
                             self.preempted_at)
