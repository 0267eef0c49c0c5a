"""KunServe's drop plan (§4.1) and its inverse, the restore plan (§4.4).

A *group* is a set of decode instances that together hold exactly one copy of the decoder
layers, each member a contiguous layer range, run as a pipeline in member order. Every
instance starts as its own group. Under overload the greedy planner merges the two smallest
groups (a min-heap keyed by group size, ties by the first member's id, so plans are
deterministic), which drops one redundant copy of the layers, P bytes, and repeats only
until the freed KV covers the demand (KunServe's requirement 3: fewer stages, less loss).
Heap operations make it O(N log N) for N instances. A request larger than any unit (a long
prompt at an otherwise idle pool, whose pool-wide free blocks already cover it) is what
KunServe makes room for: with ``fit_blocks`` the planner also merges until some unit can
take a request of that many blocks (``InstanceMemory.request_blocks``), growing the unit
that takes the most by the smallest other group, so that the group holding it has as few
stages as it can.

A plan that cannot keep one full copy of every layer in each group is refused with
``DropRefused`` and changes nothing: the caller falls back to a KV-centric policy.
Pure: no torch, no ray.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import msgspec

from tetris.control.kunserve_memory import InstanceMemory

__all__ = ["DropPlan", "DropRefused", "Group", "LayerPull", "RestorePlan", "check_group",
           "group_kv_blocks", "plan_drop", "plan_forced", "plan_restore", "request_blocks",
           "split_layers"]


class DropRefused(ValueError):
    """No drop plan keeps one full copy of the layers and covers the demand."""


class Group(msgspec.Struct, frozen=True):
    """Members in pipeline order and the layer range ``[start, end)`` each keeps."""

    members: tuple[int, ...]
    layer_ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return len(self.members)

    def held_layers(self) -> list[int]:
        return [end - start for start, end in self.layer_ranges]

    def owner_of(self, layer: int) -> int:
        for member, (start, end) in zip(self.members, self.layer_ranges, strict=True):
            if start <= layer < end:
                return member
        raise ValueError(f"layer {layer} is held by no member of {self.members}")


class DropPlan(msgspec.Struct, frozen=True):
    groups: tuple[Group, ...]
    merges: int                 # each merge dropped one copy of the layers
    freed_param_bytes: int      # merges * P
    kv_blocks_before: int       # summed over the cluster, the plan's input grouping
    kv_blocks_after: int


class LayerPull(msgspec.Struct, frozen=True):
    """Restore: ``dst`` gets layers ``[start, end)`` back from ``src`` (a peer that kept them)."""

    dst: int
    src: int
    start: int
    end: int


class RestorePlan(msgspec.Struct, frozen=True):
    groups: tuple[Group, ...]   # every instance on its own again
    pulls: tuple[LayerPull, ...]
    pulled_param_bytes: int


def split_layers(num_layers: int, n: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges for ``n`` members; the first ``num_layers % n`` get one more layer."""
    if not 1 <= n <= num_layers:
        raise DropRefused(f"{n} members cannot each keep at least one of {num_layers} layers")
    base, extra = divmod(num_layers, n)
    ranges, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return tuple(ranges)


def check_group(group: Group, num_layers: int) -> None:
    """Invariant 1: the members' ranges tile ``[0, num_layers)`` in order, none empty."""
    if len(group.members) != len(group.layer_ranges) or not group.members:
        raise DropRefused(f"group {group.members}: one layer range per member is needed")
    expected = 0
    for member, (start, end) in zip(group.members, group.layer_ranges, strict=True):
        if start != expected or end <= start:
            missing = f"layers [{expected}, {start})" if start > expected else "overlapping layers"
            raise DropRefused(f"group {group.members}: member {member} keeps [{start}, {end}): "
                              f"{missing} would lose their last copy in the group")
        expected = end
    if expected != num_layers:
        raise DropRefused(f"group {group.members}: layers [{expected}, {num_layers}) "
                          "would lose their last copy in the group")


def group_kv_blocks(mem: InstanceMemory, group: Group) -> int:
    if group.size == 1:
        return mem.kv_blocks
    return mem.group_kv_blocks(group.held_layers())


def request_blocks(mem: InstanceMemory, group: Group) -> int:
    """The largest request ``group`` (as one serving unit) can take, in blocks."""
    return mem.request_blocks(group.held_layers())


def _singletons(instances: Sequence[int], num_layers: int) -> list[Group]:
    return [Group((i,), ((0, num_layers),)) for i in instances]


def plan_drop(mem: InstanceMemory, groups: Sequence[Group] | Sequence[int], *,
              demand_blocks: int, free_blocks: int, fit_blocks: int = 0) -> DropPlan:
    """While no unit can take a request of ``fit_blocks`` blocks, merge the unit that takes the
    most with the smallest other group; then greedy §4.1: merge the two smallest groups until
    ``free_blocks`` covers ``demand_blocks``.

    ``groups``: the current grouping, or plain instance ids (each its own group).
    Raises ``DropRefused`` when one group is left, or the groups to merge cannot (more
    members than layers), before the demand is covered and the request fits.
    """
    current = list(groups)
    if current and not isinstance(current[0], Group):
        current = _singletons(current, mem.num_layers)
    for g in current:
        check_group(g, mem.num_layers)
    before = sum(group_kv_blocks(mem, g) for g in current)
    heap = [(g.size, g.members[0], g) for g in current]
    heapq.heapify(heap)
    avail, merges = free_blocks, 0
    best = max((request_blocks(mem, g) for g in current), default=0)   # any unit so far
    while True:
        if max((request_blocks(mem, g) for _, _, g in heap), default=0) < fit_blocks:
            why = f"a request of {fit_blocks} blocks fits no unit (the largest takes {best})"
            pick = _pop_fittest
        elif avail < demand_blocks:
            why, pick = f"demand {demand_blocks} blocks > {avail} free", _pop_smallest
        else:
            break
        if len(heap) < 2:
            raise DropRefused(f"{why} with one group left: dropping more would lose the last "
                              "copy of a layer")
        g1 = pick(mem, heap)
        if g1.size + heap[0][0] > mem.num_layers:
            raise DropRefused(f"{why}: merging groups of {g1.size} and {heap[0][0]} leaves a "
                              f"member with no layer of {mem.num_layers}")
        g2 = _pop_smallest(mem, heap)
        members = tuple(sorted(g1.members + g2.members))
        merged = Group(members, split_layers(mem.num_layers, len(members)))
        avail += group_kv_blocks(mem, merged) - group_kv_blocks(mem, g1) - group_kv_blocks(mem, g2)
        merges += 1
        best = max(best, request_blocks(mem, merged))
        heapq.heappush(heap, (merged.size, merged.members[0], merged))
    out = tuple(sorted((g for _, _, g in heap), key=lambda g: g.members[0]))
    return DropPlan(out, merges, merges * mem.layers_param_bytes, before,
                    sum(group_kv_blocks(mem, g) for g in out))


def _pop_smallest(mem: InstanceMemory, heap: list) -> Group:
    return heapq.heappop(heap)[2]


def _pop_fittest(mem: InstanceMemory, heap: list) -> Group:
    """The unit taking the largest request (ties: the smaller group, then the first member)."""
    i = max(range(len(heap)),
            key=lambda k: (request_blocks(mem, heap[k][2]), -heap[k][0], -heap[k][1]))
    entry = heap.pop(i)
    heapq.heapify(heap)
    return entry[2]


def plan_forced(mem: InstanceMemory, groups: Sequence[Group]) -> DropPlan:
    """An operator's drop (admin route): checked whole before anything changes."""
    seen: list[int] = []
    for g in groups:
        check_group(g, mem.num_layers)
        seen.extend(g.members)
    if len(seen) != len(set(seen)):
        raise DropRefused(f"an instance is in two groups: {sorted(seen)}")
    before = len(seen) * mem.kv_blocks
    merges = sum(g.size - 1 for g in groups)
    ordered = tuple(sorted(groups, key=lambda g: g.members[0]))
    return DropPlan(ordered, merges, merges * mem.layers_param_bytes, before,
                    sum(group_kv_blocks(mem, g) for g in ordered))


def plan_restore(mem: InstanceMemory, groups: Sequence[Group]) -> RestorePlan:
    """§4.4: every member pulls the layers it dropped from the peer that kept them."""
    pulls: list[LayerPull] = []
    singles: list[Group] = []
    for g in groups:
        check_group(g, mem.num_layers)
        for dst in g.members:
            singles.append(Group((dst,), ((0, mem.num_layers),)))
            if g.size == 1:
                continue
            for src, (start, end) in zip(g.members, g.layer_ranges, strict=True):
                if src != dst:
                    pulls.append(LayerPull(dst, src, start, end))
    pulled = sum(p.end - p.start for p in pulls) * mem.layer_param_bytes
    return RestorePlan(tuple(sorted(singles, key=lambda g: g.members[0])), tuple(pulls), pulled)
