"""KunServe's global memory manager: when to drop, when to restore (§3 workflow, §4.1, §4.4).

``KunServeController.decide`` takes one KV report per serving *unit* (an undropped instance,
or a group run as a pipeline, keyed by its first member) and answers with at most one
action: a ``DropPlan`` when some unit overloads and merging covers the queued demand, a
``RestorePlan`` for one group whose usage fell under half of its undropped capacity with
nothing queued, or nothing. ``fit_blocks`` is the blocks of the request waiting at the head
of the line (a reservation just refused, on the served pool): a drop is also planned when no
unit could take it even empty, merging until one can (``plan_drop``). A refused drop (no plan keeps one copy of every layer) is kept in
``refusals`` and the units fall back to their KV-centric policy (queue, recompute or swap).
The simulator and a live driver call it with the same reports. Pure: no torch, no ray.
"""

from __future__ import annotations

import msgspec

from tetris.control.drop_plan import (
    DropPlan,
    DropRefused,
    Group,
    RestorePlan,
    plan_drop,
    plan_forced,
    plan_restore,
    request_blocks,
)
from tetris.control.kunserve_memory import InstanceLoad, InstanceMemory, OverloadMonitor

__all__ = ["Decision", "KunServeController"]


class Decision(msgspec.Struct, frozen=True):
    kind: str                          # "drop" or "restore"
    drop: DropPlan | None = None
    restore: RestorePlan | None = None
    restored_group: Group | None = None


class KunServeController:
    """The grouping of ``instances`` and the decisions that change it."""

    def __init__(self, mem: InstanceMemory, instances: list[int],
                 monitor: OverloadMonitor | None = None) -> None:
        self.mem = mem
        self.monitor = monitor or OverloadMonitor()
        self.groups: list[Group] = [Group((i,), ((0, mem.num_layers),)) for i in instances]
        self.refusals: list[str] = []
        self.drops = 0
        self.restores = 0

    def group_of(self, leader: int) -> Group:
        return next(g for g in self.groups if g.members[0] == leader)

    def dropped_layers(self) -> dict[int, int]:
        """``tetris:dropped_layers{instance}``: layers each instance does not hold now."""
        out = {}
        for g in self.groups:
            for m, (s, e) in zip(g.members, g.layer_ranges, strict=True):
                out[m] = self.mem.num_layers - (e - s)
        return dict(sorted(out.items()))

    def fits_a_unit(self, blocks: int) -> bool:
        """Whether some current unit could take a request of ``blocks`` blocks, even empty."""
        return any(request_blocks(self.mem, g) >= blocks for g in self.groups)

    def decide(self, loads: dict[int, InstanceLoad], fit_blocks: int = 0) -> Decision | None:
        """One monitor tick: ``loads`` by unit leader (every current unit reports);
        ``fit_blocks``: the head-of-line request's blocks (0: none waiting)."""
        self.monitor.reset()
        for leader, load in loads.items():
            self.monitor.observe(leader, load)
        leaders = sorted(loads)
        if self.monitor.overloaded_instances() or not self.fits_a_unit(fit_blocks):
            demand, free = self.monitor.demand_blocks(leaders)
            used = sum(loads[u].used_blocks for u in leaders)
            try:
                plan = plan_drop(self.mem, self.groups, demand_blocks=demand - used,
                                 free_blocks=free, fit_blocks=fit_blocks)
            except DropRefused as e:
                self.refusals.append(str(e))
                return None
            if plan.merges:
                self.groups = list(plan.groups)
                self.drops += 1
                return Decision("drop", drop=plan)
            return None
        for g in self.groups:
            if g.size > 1 and self.monitor.can_restore(g.size * self.mem.kv_blocks,
                                                       [g.members[0]]):
                restore = plan_restore(self.mem, [g])
                self.groups = sorted([x for x in self.groups if x is not g]
                                     + list(restore.groups), key=lambda x: x.members[0])
                self.restores += 1
                return Decision("restore", restore=restore, restored_group=g)
        return None

    # -- an operator's actions (admin routes) --------------------------------------------------
    def force_drop(self, groups: list[Group]) -> Decision:
        """Merge undropped instances into ``groups`` now. ``DropRefused`` (and nothing
        changes) if a member is already in a group or unknown, or a group would not hold
        every layer exactly once (the last copy of a layer is never dropped)."""
        singles = {g.members[0] for g in self.groups if g.size == 1}
        busy = sorted(m for g in groups for m in g.members if m not in singles)
        if busy:
            raise DropRefused(f"instances {busy} are not undropped instances of this pool")
        plan = plan_forced(self.mem, groups)
        merged = {m for g in plan.groups for m in g.members}
        self.groups = sorted([g for g in self.groups if g.members[0] not in merged]
                             + list(plan.groups), key=lambda g: g.members[0])
        self.drops += 1
        return Decision("drop", drop=plan)

    def force_restore(self, leader: int) -> Decision:
        """Split the group led by ``leader`` back into replicas now."""
        group = next((g for g in self.groups if g.members[0] == leader and g.size > 1), None)
        if group is None:
            raise DropRefused(f"no group is led by instance {leader}")
        restore = plan_restore(self.mem, [group])
        self.groups = sorted([g for g in self.groups if g is not group] + list(restore.groups),
                             key=lambda g: g.members[0])
        self.restores += 1
        return Decision("restore", restore=restore, restored_group=group)
