"""Elastic decode in the simulator: requests whose KV spans a decode group (SIMULATION).

``ShardedDecodeSim`` is ``DecodeInstanceSim`` that may also *hold* token ranges of requests
mastered on other instances (tetris/engine/sharded_decode.py is the mechanism it models):

- a request is batched and stepped by its master; its other ranges are reserved on their
  holders from admission to finish, and the holders' attention reads them every step (their
  context grows by the range: CSPS Fig. 13, a holder computes the remote request's partial
  beside its own batch);
- admission needs room on the master *and* on every holder at once;
- the master's iteration takes its own step time or, if longer, the step of the slowest
  holder of a request in its batch (the partials come back per layer: lockstep), plus the
  q/partial exchange of the widest group in the batch (``ExchangeModel.step_time``).
A request on one instance has no holders and no exchange, so whole-request placement runs
through exactly the ``DecodeInstanceSim`` arithmetic.

``ElasticSimulation`` is the cluster ``Simulation`` with the decode side placed by the control
plane's ``ElasticPlacer`` (tetris/control/elastic.py) on the control plane's own router.
With the placer's config off every choice is the router's, and results equal ``Simulation``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from tetris.control.elastic import DecodeGroup, ElasticPlacer
from tetris.sim.cluster import Simulation
from tetris.sim.decode import DecodeInstanceSim, DecodeRequest
from tetris.sim.events import EventKind

__all__ = ["ElasticSimulation", "ShardedDecodeRequest", "ShardedDecodeSim"]


class ShardedDecodeRequest(DecodeRequest):
    """A decode request with ranges on other instances: ``remote`` [(holder, tokens)]."""

    __slots__ = ("admit_time", "holds_reserved", "remote")

    def __init__(self, request_id: str, index: int, prompt_tokens: int, output_tokens: int,
                 first_token_time: float, master_tokens: int | None = None) -> None:
        super().__init__(request_id, index, prompt_tokens, output_tokens, first_token_time)
        if master_tokens is not None:
            self.kv_tokens = master_tokens   # the master's range, the appended tokens included
        self.remote: list[tuple[ShardedDecodeSim, int]] = []
        self.admit_time = float("nan")
        self.holds_reserved = False   # the holders' ranges already have their slots

    @property
    def group_size(self) -> int:
        return 1 + len(self.remote)


class ShardedDecodeSim(DecodeInstanceSim):
    """A decode instance that masters some requests and holds ranges of others."""

    def __init__(self, index: int, tp_size: int, kv_capacity_tokens: int, max_batch_size: int,
                 step_time: Callable[[int, int, int], float],
                 exchange_time: Callable[[int], float]) -> None:
        super().__init__(index, tp_size, kv_capacity_tokens, max_batch_size, step_time)
        self.exchange_time = exchange_time
        self.held: dict[str, int] = {}      # request mastered elsewhere -> tokens held here
        self.pending_hold = 0               # held tokens of requests not yet admitted
        self._now = 0.0
        self.stall = 0.0                    # a consolidation's KV copy, paid by the next step

    def can_admit(self, req: DecodeRequest) -> bool:
        if getattr(req, "holds_reserved", True):
            return super().can_admit(req)
        return super().can_admit(req) and all(h.free_tokens >= t for h, t in req.remote)

    def enqueue(self, req: DecodeRequest) -> None:
        """Queue at the master; the holders' ranges take their slots now if they all fit
        (their KV streams to the holders at hand-off, like the master's), else at admission."""
        super().enqueue(req)
        remote = getattr(req, "remote", ())
        if remote and all(h.free_tokens >= t for h, t in remote):
            for holder, tokens in remote:
                holder.used_tokens += tokens
            req.holds_reserved = True
            return
        for holder, tokens in remote:
            holder.pending_hold += tokens

    def _admit(self) -> list[DecodeRequest]:
        admitted = super()._admit()
        for req in admitted:
            if isinstance(req, ShardedDecodeRequest):
                req.admit_time = self._now
            for holder, tokens in getattr(req, "remote", ()):
                if not req.holds_reserved:
                    holder.pending_hold -= tokens
                    holder.used_tokens += tokens
                holder.context_tokens += tokens
                holder.held[req.request_id] = tokens
        return admitted

    def partial_time(self) -> float:
        """How long this instance takes for its share of a lockstep iteration: its own step,
        or with no batch of its own, the attention reads of the ranges it holds."""
        if self.running:
            return self.step_time(self.tp_size, len(self.running), self.context_tokens)
        if not self.context_tokens:
            return 0.0
        return (self.step_time(self.tp_size, 1, self.context_tokens)
                - self.step_time(self.tp_size, 1, 0))

    def start_step(self, now: float) -> float | None:
        self._now = now
        return super().start_step(now)

    def step_duration(self) -> float:
        """The lockstep iteration: the slowest of this instance and the holders of its
        requests' ranges, plus the q/partial exchange and any stall a range move left (which
        this iteration pays once)."""
        own = super().step_duration()
        holders = {h.index: h for _, _, r in self.running for h, _ in getattr(r, "remote", ())}
        widest = max((getattr(r, "group_size", 1) for _, _, r in self.running), default=1)
        dur = max([own] + [h.partial_time() for _, h in sorted(holders.items())])
        dur += self.exchange_time(widest) + self.stall
        self.stall = 0.0
        return dur

    def finish_step(self, now: float) -> list[DecodeRequest]:
        done = super().finish_step(now)
        for req in done:
            for holder, tokens in getattr(req, "remote", ()):
                del holder.held[req.request_id]
                holder.used_tokens -= tokens
                holder.context_tokens -= tokens
        return done

    def take_range(self, req: ShardedDecodeRequest, holder: ShardedDecodeSim, tokens: int,
                   copy_time: float) -> None:
        """Consolidation: the range ``holder`` kept of ``req`` (mastered here) moves here. The
        copy stalls this instance's next step (conservative: a live copy could overlap it)."""
        req.remote = [(h, t) for h, t in req.remote if h is not holder]
        del holder.held[req.request_id]
        holder.used_tokens -= tokens
        holder.context_tokens -= tokens
        req.kv_tokens += tokens
        self.used_tokens += tokens
        self.context_tokens += tokens
        self.stall += copy_time

    def reported_free(self) -> int:
        """Free slots for the router: minus what waiting requests here and elsewhere claim."""
        return self.free_tokens - sum(r.kv_tokens for r in self.waiting) - self.pending_hold


class ElasticSimulation(Simulation):
    """``Simulation`` whose decode side is placed by ``placer`` (on ``control.router``)."""

    def __init__(self, requests, *, placer: ElasticPlacer, kv_capacity: int | None = None,
                 consolidate: bool = True, **kw: Any) -> None:
        super().__init__(requests, **kw)
        if placer.router is not self.control.router:
            raise ValueError("the placer must book on the control plane's own router")
        self.placer = placer
        exchange = placer.exchange.step_time
        cluster = self.cluster
        step = kw.get("decode_step")
        # ``kv_capacity``: an instance's KV tokens when not the cluster's GPU memory's (an
        # emulated deployment's ``kv_blocks``)
        cap = kv_capacity if kv_capacity is not None else cluster.kv_capacity_tokens(cluster.decode_tp)
        self.decoders = [
            ShardedDecodeSim(d, cluster.decode_tp, cap, cluster.decode_max_batch, step, exchange)
            for d in range(cluster.decode_instances)] if step is not None else []
        self.groups: dict[str, DecodeGroup] = {}
        self.consolidations = 0
        self.consolidate = consolidate   # off: as the served path, which never moves a range
        # what any placement could hold: one instance whole, the largest group elastic
        caps = sorted(placer.capacities, reverse=True)
        self.reachable = sum(caps[:placer.config.max_group]) if placer.config.enabled else caps[0]

    def _on_arrival(self, now: float, i: int) -> None:
        r = self.requests[i]
        control = self.control
        kv = r.prompt_tokens + r.output_tokens
        if kv > self.reachable:   # the live reservation's DecodeFull (a 429) before any prefill
            self.refused.append(i)
            return
        group = self.placer.place(r.request_id, kv, r.output_tokens)
        if self.decoders and group.tokens_on(group.master) > self.decoders[group.master].capacity:
            # no group has room now and it fits no instance whole: the live reservation
            # refuses it (DecodeFull) as it would beyond the sum
            self.placer.finished(r.request_id)
            self.refused.append(i)
            return
        self.groups[r.request_id] = group
        plan = control.plan(r.request_id, r.prompt_tokens, now)
        control.commit(plan)
        if not self.thetas or self.thetas[-1] != control.improvement_rate:
            self.thetas.append(control.improvement_rate)
        end, runs = self._execute(now, i, plan)
        ready = end
        for member in group.instances:   # each member's link carries its share of each chunk
            share = group.tokens_on(member) / kv
            scaled = [msgspec.structs.replace(c, tokens=max(1, round(c.tokens * share)))
                      for c in runs]
            self.link_free[member] = self.transfer.ready_time(scaled, self.link_free[member])
            ready = max(ready, self.link_free[member])
        req = ShardedDecodeRequest(r.request_id, i, r.prompt_tokens, r.output_tokens, end,
                                   group.tokens_on(group.master))
        req.remote = [(self.decoders[m], group.tokens_on(m)) for m in group.instances
                      if m != group.master]
        req.ready_time = ready
        self.decode_reqs[i] = req
        self.events.push(ready, EventKind.KV_READY, (group.master, req))

    def _on_kv_ready(self, now: float, d: int, req: DecodeRequest) -> None:
        self.placer.arrived(req.request_id)
        if req.remaining <= 0:
            req.finish_time = now
            self.placer.finished(req.request_id)
            return
        inst = self.decoders[d]
        inst.enqueue(req)
        self._kick(now)

    def _step_done(self, now: float, inst: DecodeInstanceSim) -> None:
        for req in inst.finish_step(now):
            self.placer.finished(req.request_id)
        if self.consolidate:
            self._consolidate(inst)
        self._kick(now, skip=inst)

    def _consolidate(self, inst: ShardedDecodeSim) -> None:
        """LoongServe §1.5 through the control plane: a sharded request's range moves onto
        its master when the placer finds the copy cheaper than the exchanges left."""
        for _, _, req in sorted(inst.running, key=lambda e: e[1]):
            if not getattr(req, "remote", None):
                continue
            moved = self.placer.consolidation(req.request_id, req.remaining)
            if moved is None or inst.free_tokens < moved.tokens:
                continue
            holder = self.decoders[moved.instance]
            inst.take_range(req, holder, moved.tokens,
                            self.placer.exchange.kv_move_time(moved.tokens))
            self.placer.moved(req.request_id, moved)
            self.consolidations += 1
            self._refresh_router(holder)
            self._refresh_router(inst)

    def _kick(self, now: float, skip: DecodeInstanceSim | None = None) -> None:
        """Start idle instances that may now admit (room freed on a holder counts)."""
        for inst in self.decoders:
            if inst is not skip and not inst.stepping and inst.waiting:
                self._start_step(now, inst)
            elif inst is not skip:
                self._refresh_router(inst)

    def _refresh_router(self, inst: DecodeInstanceSim) -> None:
        self.control.decode_report(inst.index, inst.reported_free(),
                                   inst.batch_size + len(inst.waiting))
