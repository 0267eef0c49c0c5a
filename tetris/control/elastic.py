"""Elastic decode placement: a request's KV over a *decode group* of instances.

LoongServe's elastic scale-up (loongserve-notes §1.4) and unified KV pool (§1.6), CSPS's SP
decode (csps-notes §1.11), in P/D form: at hand-off the control plane gives a request either
one decode instance (as ``DecodeRouter.choose`` does) or a group, each member holding a token
range ``[start, end)`` of its KV, the last member its master (its new KV is appended there).

Lifecycle of one run here (beside the ``ControlPlane``'s, on the same ``DecodeRouter``):

1. ``place(run_id, kv_tokens, grow_tokens)``: a ``DecodeGroup``; each range's tokens are booked as virtual
   usage on its instance (Llumnix accounting per instance);
2. ``arrived(run_id)``: every range's KV is on its holder; the virtual usage goes;
3. ``consolidation(run_id, remaining_steps)``: a range worth moving onto its master now
   that others finished (LoongServe §1.5), by ``consolidation.consolidation_cost`` (the
   exchange and the lockstep wait saved vs the copy); ``moved`` records it;
4. ``finished(run_id)``: whatever is still booked goes (idempotent); ``runs_on(instance)``
   names the runs a lost instance takes down (a holder's loss too).

When a group is chosen (``ElasticConfig``, off by default: placement is then the router's
whole-request choice, bit for bit):
- **memory**: no instance has room for the whole request, but the free room of up to
  ``max_group`` instances does (LoongServe's memory-triggered scale-up, Fig. 4's
  fragmentation);
- **time**: over the instances involved, the batch-weighted mean decode step (the mean TBT)
  with the group is at least ``min_gain`` shorter than with the router's single instance
  (the scale-up rule: spreading the attention reads of a long context saves time); the
  master's step waits for its slowest member's partials and the q/partial exchange.
Shares follow each member's free room (the fullest instances are not emptied: their room is
what other requests need), so the members' used fractions move together; the member with
the most room is the master, since output KV grows there.

Pure: no Ray, no torch, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from tetris.control.consolidation import consolidation_cost
from tetris.scheduler.router import DecodeRouter, NoInstanceUp

__all__ = ["DecodeGroup", "ElasticConfig", "ElasticPlacer", "ExchangeModel", "ShardRange",
           "StepTime"]

StepTime = Callable[[int, int, float], float]   # (tp, batch, context tokens) -> seconds


class ShardRange(msgspec.Struct, frozen=True):
    instance: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


class DecodeGroup(msgspec.Struct, frozen=True):
    """Token ranges in token order; the last range's instance is the master."""

    ranges: tuple[ShardRange, ...]

    @property
    def master(self) -> int:
        return self.ranges[-1].instance

    @property
    def instances(self) -> tuple[int, ...]:
        return tuple(sorted({r.instance for r in self.ranges}))

    @property
    def sharded(self) -> bool:
        return len(self.instances) > 1

    def tokens_on(self, instance: int) -> int:
        return sum(r.tokens for r in self.ranges if r.instance == instance)


class ElasticConfig(msgspec.Struct, frozen=True):
    enabled: bool = False
    max_group: int = 4           # most instances one request's KV may span
    min_gain: float = 0.1        # spread for time only when the step is this much shorter
    spread_for_time: bool = True


class ExchangeModel(msgspec.Struct, frozen=True):
    """Bytes and time of a decode step's q/partial exchange vs moving KV (csps-notes §2.5).

    Per layer, a master sends q (Hq·dh values) to each of the other P-1 holders and gets back
    the partial output (Hq·dh) and its LSE (Hq fp32 values); moving the KV of ``L`` remote
    tokens instead costs 2·Hkv·dh values per token and layer, once. TP ranks exchange their
    head slices in parallel over their own links, so ``link_bandwidth`` is the instance's
    (TP × NIC) and the bytes are the whole heads'.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    link_bandwidth: float = 8 * 25e9   # bytes/s of one TP-8 instance over 200 Gb/s NICs
    message_latency: float = 10e-6     # s per small message (RDMA write + completion)

    def step_bytes(self, holders: int) -> int:
        """Bytes one step of one request moves with its KV on ``holders`` instances."""
        q = self.num_heads * self.head_dim * self.dtype_bytes
        partial = q + self.num_heads * 4
        return self.num_layers * (holders - 1) * (q + partial)

    def step_time(self, holders: int) -> float:
        """Added to the master's step: per layer q out and partials back, latency-bound."""
        if holders <= 1:
            return 0.0
        per_layer = 2 * self.message_latency
        return self.num_layers * per_layer + self.step_bytes(holders) / self.link_bandwidth

    def kv_bytes(self, tokens: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes * tokens

    def kv_move_time(self, tokens: int) -> float:
        return self.kv_bytes(tokens) / self.link_bandwidth

    def choose(self, remaining_steps: int, remote_tokens: int, holders: int) -> str:
        """'move_kv' when moving the remote tokens once costs less than exchanging q and
        partials for every remaining step, else 'query'."""
        exchange = remaining_steps * (self.step_time(holders) - self.step_time(holders - 1))
        return "move_kv" if self.kv_move_time(remote_tokens) < exchange else "query"


class ElasticPlacer:
    """Places runs on ``router``'s instances (``capacities`` KV tokens each, TP ``tp_size``)."""

    def __init__(self, router: DecodeRouter, capacities: Sequence[int], step_time: StepTime,
                 tp_size: int, exchange: ExchangeModel,
                 config: ElasticConfig | None = None) -> None:
        if len(capacities) != router.num_instances:
            raise ValueError(f"{len(capacities)} capacities for {router.num_instances} instances")
        self.router = router
        self.capacities = [int(c) for c in capacities]
        self.step = step_time
        self.tp = tp_size
        self.exchange = exchange
        self.config = config if config is not None else ElasticConfig()
        self.groups: dict[str, DecodeGroup] = {}
        self._booked: dict[str, DecodeGroup] = {}   # runs whose KV is still in flight

    # -- the model ---------------------------------------------------------------------------
    def room(self, i: int) -> int:
        return self.router.free_slots[i] - self.router.virtual[i]

    def _used(self, i: int) -> int:
        return self.capacities[i] - self.room(i)

    def _instance_time(self, batch: int, context: float) -> float:
        """An instance's share of a step: its own iteration, or with no batch of its own the
        attention reads of the ranges it holds for masters elsewhere."""
        if batch:
            return self.step(self.tp, batch, context)
        return self.step(self.tp, 1, context) - self.step(self.tp, 1, 0) if context else 0.0

    def group_step_time(self, group: DecodeGroup) -> float:
        """Modelled step of the request's master with the request placed as ``group``: every
        member reads its range (the master's batch gains the request), the master waits for
        the slowest member's partials (lockstep), plus the q/partial exchange."""
        return self._step_times(group)[group.master]

    def _step_times(self, group: DecodeGroup, others: tuple[int, ...] = ()) -> dict[int, float]:
        times = {}
        for i in sorted(set(group.instances) | set(others)):
            batch = self.router.batch_size[i] + (i == group.master)
            times[i] = self._instance_time(batch, self._used(i) + group.tokens_on(i))
        times[group.master] = (max(times[i] for i in group.instances)
                               + self.exchange.step_time(len(group.instances)))
        return times

    def mean_step_time(self, group: DecodeGroup, touched: tuple[int, ...]) -> float:
        """Batch-weighted mean step (the mean TBT) over the ``touched`` instances with the
        request placed as ``group``: what spreading must shorten, not just the request's own
        step (a holder's batch reads the range too; the master's batch waits for it)."""
        times = self._step_times(group, touched)
        weights = {i: self.router.batch_size[i] + (i == group.master) for i in times}
        total = sum(weights.values())
        return sum(weights[i] * times[i] for i in sorted(times)) / total

    # -- placement ---------------------------------------------------------------------------
    def candidate_groups(self, kv_tokens: int, grow_tokens: int = 0,
                         avoid: frozenset[int] = frozenset()) -> list[DecodeGroup]:
        """Groups of 2..max_group instances, the freest first, whose room holds the request;
        the master (the freest) keeps room for the ``grow_tokens`` appended while decoding."""
        up = [i for i in range(self.router.num_instances)
              if i not in self.router.down and i not in avoid and self.room(i) > 0]
        up.sort(key=lambda i: (-self.room(i), i))
        groups = []
        for k in range(2, min(self.config.max_group, len(up)) + 1):
            members = up[:k]
            if sum(self.room(i) for i in members) >= kv_tokens and self.room(up[0]) >= grow_tokens:
                groups.append(self._split(kv_tokens, grow_tokens, members))
        return groups

    def _split(self, kv_tokens: int, grow_tokens: int, members: list[int]) -> DecodeGroup:
        """The first ``kv_tokens - grow_tokens`` tokens (the prompt) by the members' room left
        after the master's ``grow_tokens``; the master (members[0]) takes the rest and every
        appended token, so a range never grows anywhere but at the master."""
        room = {i: self.room(i) for i in members}
        room[members[0]] -= grow_tokens
        total = sum(room.values())
        prompt = kv_tokens - grow_tokens
        shares = {i: prompt * room[i] // total for i in members[1:]} if total > 0 else {}
        shares[members[0]] = kv_tokens - sum(shares.values())
        order = sorted(members[1:]) + [members[0]]
        ranges, start = [], 0
        for i in order:
            if shares.get(i, 0) > 0:
                ranges.append(ShardRange(i, start, start + shares[i]))
                start += shares[i]
        return DecodeGroup(tuple(ranges))

    def choose(self, kv_tokens: int, grow_tokens: int = 0,
               avoid: frozenset[int] = frozenset()) -> DecodeGroup:
        """The group for a request of ``kv_tokens`` (prompt and output), ``grow_tokens`` of
        them appended while decoding (at the master), booking nothing."""
        single = self.router.choose(kv_tokens, avoid)
        whole = DecodeGroup((ShardRange(single, 0, kv_tokens),))
        if not self.config.enabled:
            return whole
        groups = self.candidate_groups(kv_tokens, grow_tokens, avoid)
        if self.room(single) < kv_tokens:          # memory: no single instance has room
            return groups[0] if groups else whole  # none either: wait on the freest, as today
        if not self.config.spread_for_time or not groups:
            return whole
        gains = []
        for g in groups:   # each against whole placement over the same instances
            touched = tuple(sorted(set(g.instances) | {single}))
            ratio = self.mean_step_time(g, touched) / self.mean_step_time(whole, touched)
            gains.append((ratio, len(g.ranges), g))
        ratio, _, best = min(gains, key=lambda x: x[:2])
        return best if ratio <= 1 - self.config.min_gain else whole

    def place(self, run_id: str, kv_tokens: int, grow_tokens: int = 0,
              avoid: frozenset[int] = frozenset()) -> DecodeGroup:
        """Choose and book: each range's tokens count as virtual usage on its instance."""
        if run_id in self.groups:
            raise ValueError(f"run {run_id!r} is already placed")
        if len(self.router.down) == self.router.num_instances:
            raise NoInstanceUp(f"all {self.router.num_instances} decode instances are down")
        group = self.choose(kv_tokens, grow_tokens, avoid)
        for r in group.ranges:
            self.router.reserve(r.instance, r.tokens)
        self.groups[run_id] = group
        self._booked[run_id] = group
        return group

    def arrived(self, run_id: str) -> None:
        group = self._booked.pop(run_id, None)
        for r in group.ranges if group is not None else ():
            self.router.release(r.instance, r.tokens)

    def finished(self, run_id: str) -> None:
        self.arrived(run_id)
        self.groups.pop(run_id, None)

    def runs_on(self, instance: int) -> list[str]:
        """Runs with any range on ``instance``, sorted: losing it loses each of them (every
        one goes down the resume path, not only those it masters)."""
        return sorted(run for run, g in self.groups.items() if instance in g.instances)

    # -- consolidation (LoongServe §1.5) -----------------------------------------------------
    def consolidation(self, run_id: str, remaining_steps: int) -> ShardRange | None:
        """A range of the run worth moving onto its master now: the master has room for it
        and moving it once costs its batch less than the steps left lose to the exchange and
        to waiting for that holder (``consolidation.consolidation_cost``)."""
        group = self.groups.get(run_id)
        if group is None or not group.sharded:
            return None
        for r in sorted(group.ranges, key=lambda r: (r.tokens, r.start)):
            if r.instance == group.master or self.room(group.master) < r.tokens:
                continue
            if group.tokens_on(r.instance) != r.tokens:
                continue   # the holder keeps another range: moving this one saves no exchange
            if consolidation_cost(self, group, r).worth(remaining_steps):
                return r
        return None

    def moved(self, run_id: str, moved: ShardRange) -> DecodeGroup:
        """Record that ``moved`` now lies on the master (the caller moved the KV and reports
        both instances' slots through ``DecodeRouter.update``)."""
        group = self.groups[run_id]
        ranges = tuple(ShardRange(group.master, r.start, r.end) if r == moved else r
                       for r in group.ranges)
        self.groups[run_id] = DecodeGroup(ranges)
        return self.groups[run_id]
