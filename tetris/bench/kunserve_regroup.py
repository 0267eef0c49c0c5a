"""EMULATION of a KunServe decode pool: the monitor and the regrouping, mixed into
``KunServeEmulation`` (tetris/bench/kunserve_emulated.py).

Every ``tick_s`` the monitor sends each unit's KV report (``InstanceLoad``, read from its block
manager) to ``KunServeController.decide``; a drop or restore makes the units match the
controller's groups: the units replaced finish their iteration in flight, their sequences are
taken and given to the new units, held out of the batch for the KV exchange
(``bytes (g - 1) / g`` each, queued on the old unit's links:
  ``ExchangeQueue``, the simulator's).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tetris.control.kunserve_memory import InstanceLoad
from tetris.sim.kunserve import KunRequest
from tetris.sim.kunserve_exchange import ExchangeQueue

if TYPE_CHECKING:
    from tetris.bench.kunserve_emulated import _Unit

__all__ = ["KunServeRegrouping"]


class KunServeRegrouping:
    """Mixed into ``KunServeEmulation``: the monitor loop and the regrouping of units."""

    def _load(self, u: _Unit, queued: int, total: int) -> InstanceLoad:
        """A unit's KV report, read from its block manager (as ``KunServeSim._tick``)."""
        b = u.engine.blocks
        growth = sum(1 for s in u.engine.batcher.running
                     if b.blocks_needed(s.num_tokens + 1) > len(s.block_table))
        return InstanceLoad(b.num_blocks, b.num_blocks - b.num_free_blocks, growth,
                            queued * b.num_blocks // total)

    def _monitor_loop(self) -> None:
        tick = self.prof.tick_s
        k = 1
        while True:
            wait = k * tick * self.scale - (time.monotonic() - self.t0)
            if wait > 0:
                time.sleep(wait)
            k += 1
            with self.lock:
                if self.closing:
                    return
                bs = self.mem.block_size
                needs = [-(-(r.prompt + len(self.generated.get(r.rid, ())) + 1) // bs)
                         for r in self.waiting]          # a requeued victim's output too
                queued = sum(needs)
                total = sum(u.engine.blocks.num_blocks for u in self.units)
                loads = {u.members[0]: self._load(u, queued, total) for u in self.units}
                # the head of the FIFO queue, as the simulator's _tick passes it
                if self.control.decide(loads, fit_blocks=needs[0] if needs else 0) is None:
                    continue
                at = self.now()
            self.regroup(at)

    def regroup(self, at: float | None = None) -> None:
        """Make the units match ``control.groups`` (after a decision at trace time ``at``, or
        an operator's action): the units to replace start no further iteration (``holding``)
        and finish the one in flight, all at once, as the simulator's regrouping waits only
        for the iterations in flight. (Taking each unit's step lock while it went on stepping
        let a unit run several more iterations first, by how the threads happened to be
        scheduled: the run-to-run spread of the preemptions before a drop.)"""
        while True:
            with self.lock:
                member_sets = [g.members for g in self.control.groups]
                old = [u for u in self.units if u.members not in member_sets]
                for u in old:
                    u.holding = True
                steps = [u.engine.steps for u in old]
            if not old:
                return
            for u in old:
                u.step_lock.acquire()
            try:
                with self.lock:
                    if [g.members for g in self.control.groups] != member_sets:
                        for u in old:
                            u.holding = False
                        continue           # changed meanwhile (the monitor, or an operator)
                    # iterations each replaced unit finished after the decision: only the
                    # one in flight (<= 1) when holding works
                    self.regroup_iterations = max(
                        self.regroup_iterations,
                        *(u.engine.steps - n for u, n in zip(old, steps, strict=True)))
                    self._move(old, member_sets, at)
                    now = self.now()
                    self.dropped_layers_log.append((now, self.control.dropped_layers()))
                    self.regroup_log.append((now if at is None else at, now))
                    self._admit()
                    self.cv.notify_all()
                    return
            finally:
                for u in old:
                    u.step_lock.release()

    def _move(self, old: list[_Unit], member_sets: list[tuple[int, ...]],
              at: float | None) -> None:
        """The old units' sequences go to the new ones; a decoding one waits for its KV
        exchange, queued from ``at`` (the decision's time; now if None) on its old unit's
        links (``ExchangeQueue``, as the simulator)."""
        kept = {u.members: u for u in self.units if u not in old}
        fresh = []
        for members in member_sets:
            if members not in kept:
                group = self.control.group_of(members[0])
                held = tuple(e - s for s, e in group.layer_ranges)
                blocks = (self.mem.group_kv_blocks(held) if len(members) > 1
                          else self.mem.kv_blocks)
                fresh.append(self._unit(members, blocks, held))
                if len(members) > 1:
                    self.group_blocks_seen[members] = blocks
        now = self.now() if at is None else at
        for o in old:
            o.stopped = True
            g = max(len(o.members), *(len(u.members) for u in fresh))
            links = ExchangeQueue(now, len(o.members), self.prof.link_bytes_per_s)
            for seq, blocks in o.engine.take():
                rid = int(seq.request_id)
                u = self._target(self.reqs[rid], blocks, fresh)
                ready = now
                if seq.num_computed:       # decoding: its KV is exchanged (in prefill: its
                    nbytes = blocks * self.mem.block_bytes * (g - 1) / g   # KV streams there)
                    self.exchange_bytes += nbytes
                    ready = max(links.send(nbytes), (o.engine.step_end - self.t0) / self.scale)
                u.engine.give(seq, ready)
                self.unit_of[rid] = u
        self.units = sorted([*kept.values(), *fresh], key=lambda u: u.members[0])
        for u in fresh:
            self._start(u)

    def _target(self, r: KunRequest, blocks: int, fresh: list[_Unit]) -> _Unit:
        homes = [u for u in fresh if r.home in u.members]
        if homes and homes[0].engine.blocks.num_free_blocks >= blocks:
            return homes[0]
        return max(fresh, key=lambda x: (x.engine.blocks.num_free_blocks, -x.members[0]))
