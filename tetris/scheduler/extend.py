"""Topology-aware instance-group growth: ``extend(G, s, P)`` of SPEC §3 / paper §5.1.

1. ``G`` empty: if ``s`` fits in one node, take the node whose ``s``-th shortest queue is
   smallest and its ``s`` shortest-queued instances; if ``s`` spans whole nodes, take whole
   nodes by shortest full-node queue (the node's longest queue: when all of it is free), then
   the remainder by the one-node rule over the nodes left.
2. ``G`` non-empty: keep ``G`` (its members keep their ring positions), add the
   shortest-queued free instances of the nodes ``G`` already uses, then rule 1 over the
   untouched nodes.

Why the CDSP search can reuse one ``GroupBuilder`` for the whole decision: Eq. 2 only changes
the queue times of a chunk's own members, and every later group contains them, so which
instances ``extend`` *adds* depends only on the untouched queue times of non-members. A group
is therefore fixed by the sequence of SP sizes that built it (its *chain*), and is memoised
by that chain. Ties break on node index, then instance index, so plans are deterministic.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["Group", "GroupBuilder"]


class Group:
    """An instance group: members in ring order, as a set, the nodes used, max queue time."""

    __slots__ = ("members", "member_set", "nodes", "max_queue")

    def __init__(self, members: tuple[int, ...], member_set: frozenset[int],
                 nodes: tuple[int, ...], max_queue: float):
        self.members = members
        self.member_set = member_set
        self.nodes = nodes
        self.max_queue = max_queue


_EMPTY = Group((), frozenset(), (), float("-inf"))


class GroupBuilder:
    """``extend`` over one snapshot of queue times, memoised by chain of SP sizes."""

    __slots__ = ("queue", "node_of", "node_ids", "by_node", "_memo")

    def __init__(self, queue: Sequence[float], node_of: Sequence[int]):
        self.queue = queue
        self.node_of = node_of
        # One sort of the whole pool, then bucketing keeps each node's list sorted by (q, i).
        order = sorted(range(len(queue)), key=queue.__getitem__)
        by_node: dict[int, list[int]] = {}
        for i in order:
            by_node.setdefault(node_of[i], []).append(i)
        self.node_ids: tuple[int, ...] = tuple(sorted(by_node))
        self.by_node = by_node
        self._memo: dict[tuple[int, ...], Group] = {(): _EMPTY}

    def group(self, chain: tuple[int, ...]) -> Group:
        """The group built by extending from empty through the SP sizes of ``chain``."""
        g = self._memo.get(chain)
        if g is None:
            g = self.extend(self.group(chain[:-1]), chain[-1])
            self._memo[chain] = g
        return g

    def extend(self, g: Group, s: int) -> Group:
        need = s - len(g.members)
        if need < 0:
            raise ValueError(f"cannot shrink a group of {len(g.members)} to SP size {s}")
        if need == 0:
            return g
        if need + len(g.members) > len(self.queue):
            raise ValueError(f"SP size {s} exceeds the pool of {len(self.queue)} instances")
        added: list[int] = []
        if g.nodes:
            free = [i for n in g.nodes for i in self.by_node[n] if i not in g.member_set]
            if len(free) > need:
                q = self.queue
                free.sort(key=lambda i: (q[i], i))
                free = free[:need]
            added.extend(free)
            need -= len(free)
        new_nodes: list[int] = []
        if need:
            used = set(g.nodes)
            untouched = [n for n in self.node_ids if n not in used]
            self._fill_from_untouched(untouched, need, added, new_nodes)
        added.sort(key=lambda i: (self.node_of[i], i))
        members = g.members + tuple(added)
        mq = max(g.max_queue, max(self.queue[i] for i in added))
        nodes = tuple(sorted(g.nodes + tuple(new_nodes)))
        return Group(members, g.member_set.union(added), nodes, mq)

    def _fill_from_untouched(self, untouched: list[int], need: int, added: list[int],
                             new_nodes: list[int]) -> None:
        """Rule 1 over fully free nodes: whole nodes while ``need`` spans one, then one node."""
        q, by_node = self.queue, self.by_node
        while need:
            fits = [n for n in untouched if len(by_node[n]) >= need]
            if fits:
                # The node whose need-th shortest queue is smallest starts the soonest.
                n = min(fits, key=lambda n: (q[by_node[n][need - 1]], n))
                added.extend(by_node[n][:need])
                new_nodes.append(n)
                return
            if not untouched:
                raise ValueError("pool has too few instances for the requested SP size")
            n = min(untouched, key=lambda n: (q[by_node[n][-1]], -len(by_node[n]), n))
            untouched.remove(n)
            added.extend(by_node[n])
            new_nodes.append(n)
            need -= len(by_node[n])
