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
as a tree: each group keeps the groups extended from it by SP size. Ties break on node index, then instance index, so plans are deterministic.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["Group", "GroupBuilder", "node_members"]


def node_members(node_of: Sequence[int]) -> list[tuple[int, list[int]]]:
    """``(node, its instances ascending)`` for each node, by node index: the pool's topology."""
    nodes: dict[int, list[int]] = {}
    for i, n in enumerate(node_of):
        nodes.setdefault(n, []).append(i)
    return sorted(nodes.items())


class Group:
    """An instance group: members per node, its max queue time, and (lazily) its ring order.

    Within a node, ``extend`` always takes the shortest-queued instances first, so a group's
    members on node ``n`` are exactly the first ``counts[n]`` of that node's queue-sorted list;
    a group is grown by counting, never by scanning its members. Most groups of a search are
    only asked for their ``max_queue``, so ``counts`` (needed to grow a group further) and the
    ring order (parent's members, then the new ones node by node, by index) are built on demand.
    """

    __slots__ = ("size", "max_queue", "parent", "takes", "children", "_counts", "_partial",
                 "_members", "_by_node")

    def __init__(self, size: int, max_queue: float, parent: "Group | None" = None,
                 takes: dict[int, int] | None = None,
                 by_node: dict[int, list[int]] | None = None):
        self.size = size
        self.max_queue = max_queue
        self.parent = parent
        self.takes = takes  # node -> instances added to the parent there
        self._by_node = by_node
        self.children: dict[int, Group] = {}  # SP size -> extend(self, size), memoised
        root = parent is None
        self._counts: dict[int, int] | None = {} if root else None
        self._partial: list[int] | None = [] if root else None
        self._members: tuple[int, ...] | None = () if root else None

    @property
    def counts(self) -> dict[int, int]:
        """Members per node."""
        if self._counts is None:
            counts = dict(self.parent.counts)
            for n, k in self.takes.items():
                counts[n] = counts.get(n, 0) + k
            self._counts = counts
        return self._counts

    @property
    def partial(self) -> list[int]:
        """Nodes in use that still have free instances, ascending."""
        if self._partial is None:
            counts, by_node = self.counts, self._by_node
            self._partial = sorted(n for n in set(self.parent.partial).union(self.takes)
                                   if counts[n] < len(by_node[n]))
        return self._partial

    @property
    def members(self) -> tuple[int, ...]:
        if self._members is None:
            added: list[int] = []
            pc = self.parent.counts
            for n in sorted(self.takes):
                c0 = pc.get(n, 0)
                added.extend(sorted(self._by_node[n][c0:c0 + self.takes[n]]))
            self._members = self.parent.members + tuple(added)
        return self._members


class GroupBuilder:
    """``extend`` over one snapshot of queue times, memoised by chain of SP sizes."""

    __slots__ = ("queue", "by_node", "node_size", "root", "_rank", "_full_rank")

    def __init__(self, queue: Sequence[float], topology: list[tuple[int, list[int]]]):
        """``topology`` is ``node_members(node_of)``, computed once per pool layout."""
        self.queue = queue
        key = queue.__getitem__
        # Each node's instances by queue time; a stable sort keeps ties in index order.
        by_node = {n: sorted(members, key=key) for n, members in topology}
        self.by_node = by_node
        sizes = {len(v) for v in by_node.values()}
        # Equal nodes (the usual case) allow rule 1 in one step; 0 means "nodes differ".
        self.node_size = sizes.pop() if len(sizes) == 1 else 0
        self._rank: dict[int, list[int]] = {}
        self._full_rank: list[int] | None = None
        self.root = Group(0, float("-inf"))  # the empty group of a new request

    def child(self, g: Group, s: int) -> Group:
        """``extend(g, s)``, memoised on ``g``."""
        c = g.children.get(s)
        if c is None:
            c = g.children[s] = self.extend(g, s)
        return c

    def group(self, chain: tuple[int, ...]) -> Group:
        """The group built by extending from empty through the SP sizes of ``chain``."""
        g = self.root
        for s in chain:
            g = self.child(g, s)
        return g

    def extend(self, g: Group, s: int) -> Group:
        need = s - g.size
        if need < 0:
            raise ValueError(f"cannot shrink a group of {g.size} to SP size {s}")
        if need == 0:
            return g
        if s > len(self.queue):
            raise ValueError(f"SP size {s} exceeds the pool of {len(self.queue)} instances")
        by_node, counts = self.by_node, g.counts
        takes: dict[int, int] = {}  # node -> instances added there
        partial = g.partial
        if len(partial) == 1:
            n = partial[0]
            members = by_node[n]
            c0 = counts[n]
            if c0 + need <= len(members):
                # Fast path (the commonest growth): the node in use has room for all of it.
                last = self.queue[members[c0 + need - 1]]
                return Group(s, last if last > g.max_queue else g.max_queue, g, {n: need},
                             by_node)
            takes[n] = len(members) - c0
        elif partial:
            # Rule 2 over several nodes: the globally shortest-queued free instances.
            q = self.queue
            free = sorted((q[i], i, n) for n in partial for i in by_node[n][counts[n]:])
            for _, _, n in free[:need]:
                takes[n] = takes.get(n, 0) + 1
        need -= sum(takes.values())
        if need:
            self._fill_from_untouched(need, counts, takes)
        q = self.queue
        mq = g.max_queue
        for n, k in takes.items():
            # node lists are queue-sorted: the last instance taken there waits longest
            last = q[by_node[n][counts.get(n, 0) + k - 1]]
            if last > mq:
                mq = last
        return Group(s, mq, g, takes, by_node)

    def rank(self, r: int) -> list[int]:
        """Nodes with at least ``r`` instances, by their ``r``-th shortest queue, then index."""
        nodes = self._rank.get(r)
        if nodes is None:
            q = self.queue
            nodes = [n for _, n in sorted([(q[bn[r - 1]], n) for n, bn in self.by_node.items()
                                           if len(bn) >= r])]
            self._rank[r] = nodes
        return nodes

    def full_rank(self) -> list[int]:
        """Nodes by the time all of them is free; larger nodes first on ties."""
        if self._full_rank is None:
            q = self.queue
            self._full_rank = [n for *_, n in sorted(
                [(q[bn[-1]], -len(bn), n) for n, bn in self.by_node.items()])]
        return self._full_rank

    def _fill_from_untouched(self, need: int, counts: dict[int, int],
                             takes: dict[int, int]) -> None:
        """Rule 1 over untouched nodes: whole nodes while ``need`` spans one, then one node."""
        by_node, k = self.by_node, self.node_size
        if k:
            whole, rem = divmod(need, k)
            if whole:
                # With equal nodes the full-node order is rank(k): whole nodes go first.
                for n in self.full_rank():
                    if n not in counts and n not in takes:
                        takes[n] = k
                        whole -= 1
                        if not whole:
                            break
                if whole:
                    raise ValueError("pool has too few instances for the requested SP size")
            need = rem
        while need:
            for n in self.rank(need):
                if n not in counts and n not in takes:
                    # The node whose need-th shortest queue is smallest starts the soonest.
                    takes[n] = need
                    return
            n = next((n for n in self.full_rank() if n not in counts and n not in takes), None)
            if n is None:
                raise ValueError("pool has too few instances for the requested SP size")
            takes[n] = len(by_node[n])
            need -= len(by_node[n])
