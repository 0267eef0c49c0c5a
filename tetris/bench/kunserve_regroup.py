"""EMULATION of a KunServe decode pool: the monitor and the regrouping, mixed into
``KunServeEmulation`` (tetris/bench/kunserve_emulated.py).

Every ``tick_s`` the monitor sends each unit's KV report (``InstanceLoad``, read from its block
manager) to ``KunServeController.decide``; a drop or restore makes the units match the
controller's groups: the units replaced finish their iteration in flight, their sequences are
taken and given to the new units, held out of the batch for the KV exchange
(``bytes (g - 1) / g / link``, the simulator's formula).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tetris.control.kunserve_memory import InstanceLoad
from tetris.sim.kunserve import KunRequest

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
                queued = sum(-(-(r.prompt + len(self.generated.get(r.rid, ())) + 1) // bs)
                             for r in self.waiting)      # a requeued victim's output too
                total = sum(u.engine.blocks.num_blocks for u in self.units)
                loads = {u.members[0]: self._load(u, queued, total) for u in self.units}
                if self.control.decide(loads) is None:
                    continue
            self.regroup()

    def regroup(self) -> None:
        """Make the units match ``control.groups`` (after a decision or an operator's action):
        the units to replace finish their iteration in flight first."""
        while True:
            with self.lock:
                member_sets = [g.members for g in self.control.groups]
                old = [u for u in self.units if u.members not in member_sets]
            if not old:
                return
            for u in old:
                u.step_lock.acquire()
            try:
                with self.lock:
                    if [g.members for g in self.control.groups] != member_sets:
                        continue           # changed meanwhile (the monitor, or an operator)
                    self._move(old, member_sets)
                    self.dropped_layers_log.append((self.now(), self.control.dropped_layers()))
                    self._admit()
                    self.cv.notify_all()
                    return
            finally:
                for u in old:
                    u.step_lock.release()

    def _move(self, old: list[_Unit], member_sets: list[tuple[int, ...]]) -> None:
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
        g = max(len(m) for m in [*(u.members for u in old), *(u.members for u in fresh)])
        now = self.now()
        for o in old:
            o.stopped = True
            for seq, blocks in o.engine.take():
                rid = int(seq.request_id)
                u = self._target(self.reqs[rid], blocks, fresh)
                nbytes = blocks * self.mem.block_bytes * (g - 1) / g
                self.exchange_bytes += nbytes
                u.engine.give(seq, now + nbytes / self.prof.link_bytes_per_s)
                self.unit_of[rid] = u
        self.units = sorted([*kept.values(), *fresh], key=lambda u: u.members[0])
        for u in fresh:
            self._start(u)

    def _target(self, r: KunRequest, blocks: int, fresh: list[_Unit]) -> _Unit:
        homes = [u for u in fresh if r.home in u.members]
        if homes and homes[0].engine.blocks.num_free_blocks >= blocks:
            return homes[0]
        return max(fresh, key=lambda x: (x.engine.blocks.num_free_blocks, -x.members[0]))
