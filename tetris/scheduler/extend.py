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
instances ``extend`` *adds* depends only on the untouched queue times of non-members.

How a group is held (the search builds dozens per decision, so this is the hot path):

- Within a node, ``extend`` always takes the shortest-queued instances first, so a group is
  "the first ``c_n`` instances of node ``n``'s queue-sorted list" for each node.
- At most one node of a group is partly used: rule 1 leaves at most one node partial (whole
  nodes, then one remainder node), and rule 2 fills that node before touching another. So a
  ``Group`` is a bitmask of the nodes it uses plus (partial node, its count): a few ints.
- ``extend`` depends only on that instance set, so equal sets reached by different chains of
  SP sizes (8 -> 16 and 16 alone, say) are one ``Group`` object, and the extensions of one are
  the extensions of all: about a third of the groups a search asks for are built.
- Only the ring order depends on the chain (a group's members keep their positions when it
  grows; the added ones follow, node by node, by index). It is built only for the chosen
  plan, from consecutive groups of the chain: ``GroupBuilder.ring``.

Ties break on node index, then instance index, so plans are deterministic.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = ["Group", "GroupBuilder", "Ring", "Topology", "node_members"]


class Topology(list):
    """``node_members``' result, a list of ``(node, its instances ascending)`` by node index,
    plus what ``GroupBuilder`` derives from it once per pool layout rather than per decision."""

    __slots__ = ("spans", "node_size", "num_instances")

    def __init__(self, nodes: Sequence[tuple[int, list[int]]]):
        super().__init__(nodes)
        members = [m for _, m in self]
        lens = {len(m) for m in members}
        # Equal nodes (the usual case) allow rule 1 in one step; 0 means "nodes differ".
        self.node_size = lens.pop() if len(lens) == 1 else 0
        self.num_instances = sum(len(m) for m in members)
        # Nodes numbered block by block let a decision sort queue slices instead of gathering.
        contiguous = all(m == list(range(m[0], m[0] + len(m))) for m in members if m)
        self.spans = [(m[0], m[0] + len(m)) for m in members] if contiguous else None


def node_members(node_of: Sequence[int]) -> Topology:
    """``(node, its instances ascending)`` for each node, by node index: the pool's topology."""
    nodes: dict[int, list[int]] = {}
    for i, n in enumerate(node_of):
        nodes.setdefault(n, []).append(i)
    return Topology(sorted(nodes.items()))


class Group:
    """An instance set: ``used`` has bit ``p`` set for each node position ``p`` (nodes by index)
    it uses, all of each node except ``part``, of which it holds the first ``cnt``
    (``part`` is -1 when every used node is whole). ``children`` memoises ``extend`` by SP size."""

    __slots__ = ("size", "max_queue", "used", "part", "cnt", "children")

    def __init__(self, size: int, max_queue: float, used: int, part: int, cnt: int):
        self.size = size
        self.max_queue = max_queue
        self.used = used
        self.part = part
        self.cnt = cnt
        self.children: dict[int, Group] = {}


class Ring(NamedTuple):
    """A group reached through a chain of SP sizes, with its members in ring order."""

    size: int
    max_queue: float
    members: tuple[int, ...]


class GroupBuilder:
    """``extend`` over one snapshot of queue times; one ``Group`` per distinct instance set."""

    __slots__ = ("queue", "topology", "nodeq", "node_size", "root", "_groups", "_rank",
                 "_full_rank", "_by_node")

    def __init__(self, queue: Sequence[float], topology: Sequence[tuple[int, list[int]]]):
        """``topology`` is ``node_members(node_of)``, computed once per pool layout."""
        top = topology if isinstance(topology, Topology) else Topology(topology)
        self.queue = queue
        self.topology = top
        # nodeq[p]: node p's queue times ascending; nodeq[p][c - 1] is when its c
        # shortest-queued instances are all free.
        if top.spans is not None:
            self.nodeq = [sorted(queue[a:b]) for a, b in top.spans]
        else:
            self.nodeq = [sorted([queue[i] for i in m]) for _, m in top]
        self.node_size = top.node_size
        self.root = Group(0, float("-inf"), 0, -1, 0)  # the empty group of a new request
        self._groups: dict[tuple[int, int, int], Group] = {}
        self._rank: dict[int, list[int]] = {}
        self._full_rank: list[int] | None = None
        self._by_node: dict[int, list[int]] = {}

    def child(self, g: Group, s: int) -> Group:
        """``extend(g, s)``, memoised on ``g``."""
        c = g.children.get(s)
        if c is None:
            c = g.children[s] = self.extend(g, s)
        return c

    def chain(self, sizes: Sequence[int]) -> list[Group]:
        """The groups built by extending from empty through ``sizes`` in turn."""
        out, g = [], self.root
        for s in sizes:
            g = self.child(g, s)
            out.append(g)
        return out

    def group(self, chain: Sequence[int]) -> Ring:
        """The group built by extending from empty through the SP sizes of ``chain``."""
        groups = self.chain(chain)
        if not groups:
            return Ring(0, self.root.max_queue, ())
        g = groups[-1]
        return Ring(g.size, g.max_queue, self.ring(groups)[-1])

    def extend(self, g: Group, s: int) -> Group:
        need = s - g.size
        if need <= 0:
            if need == 0:
                return g
            raise ValueError(f"cannot shrink a group of {g.size} to SP size {s}")
        if s > self.topology.num_instances:
            raise ValueError(
                f"SP size {s} exceeds the pool of {self.topology.num_instances} instances")
        used, part, cnt, mq = g.used, g.part, 0, g.max_queue
        nodeq = self.nodeq
        if part >= 0:
            # Rule 2: the one partly used node first, shortest queues first.
            q = nodeq[part]
            c = g.cnt + need
            if c < len(q):
                last = q[c - 1]
                cnt, need = c, 0
            else:
                last = q[-1]
                need = c - len(q)
                part = -1
            if last > mq:
                mq = last
        if need:
            # Rule 1 over the untouched nodes.
            used, part, cnt, mq = self._fill_from_untouched(need, used, mq)
        # One Group per instance set: its extensions are shared by every chain reaching it.
        key = (used, part, cnt)
        found = self._groups.get(key)
        if found is None:
            found = self._groups[key] = Group(s, mq, used, part, cnt)
        return found

    def _fill_from_untouched(self, need: int, used: int, mq: float
                             ) -> tuple[int, int, int, float]:
        """Rule 1: whole nodes while ``need`` spans one, then one node; returns the new
        ``(used, partial node, its count, max queue)``."""
        nodeq, k = self.nodeq, self.node_size
        if k:
            whole, need = divmod(need, k)
            if whole:
                # Whole nodes by the time all of them is free: with equal nodes that order is
                # rule 1's too, and the last node taken waits longest.
                for p in self._full_rank or self.full_rank():
                    if not used >> p & 1:
                        used |= 1 << p
                        whole -= 1
                        if not whole:
                            break
                if whole:
                    raise ValueError("pool has too few instances for the requested SP size")
                last = nodeq[p][-1]
                if last > mq:
                    mq = last
        while need:
            for p in self._rank.get(need) or self.rank(need):
                if not used >> p & 1:
                    # The node whose need-th shortest queue is smallest starts the soonest.
                    q = nodeq[p]
                    last = q[need - 1]
                    if last > mq:
                        mq = last
                    used |= 1 << p
                    if need < len(q):
                        return used, p, need, mq
                    return used, -1, 0, mq
            p = next((p for p in self.full_rank() if not used >> p & 1), -1)
            if p < 0:
                raise ValueError("pool has too few instances for the requested SP size")
            used |= 1 << p
            last = nodeq[p][-1]
            if last > mq:
                mq = last
            need -= len(nodeq[p])
        return used, -1, 0, mq

    def rank(self, r: int) -> list[int]:
        """Nodes with at least ``r`` instances, by their ``r``-th shortest queue, then index."""
        nodes = self._rank.get(r)
        if nodes is None:
            nq = self.nodeq
            if self.node_size:
                col = [q[r - 1] for q in nq]
                # A stable sort over positions in node-index order breaks ties on the index.
                nodes = sorted(range(len(nq)), key=col.__getitem__)
            else:
                nodes = sorted([p for p in range(len(nq)) if len(nq[p]) >= r],
                               key=lambda p: nq[p][r - 1])
            self._rank[r] = nodes
        return nodes

    def full_rank(self) -> list[int]:
        """Nodes by the time all of them is free; larger nodes first on ties."""
        if self._full_rank is None:
            nq = self.nodeq
            if self.node_size:
                self._full_rank = self.rank(self.node_size)
            else:
                self._full_rank = sorted(range(len(nq)), key=lambda p: (nq[p][-1], -len(nq[p])))
        return self._full_rank

    # ---- ring order (only for the groups of a chosen plan) ----------------------------------

    def ring(self, chain: Sequence[Group]) -> list[tuple[int, ...]]:
        """Members in ring order of each group of a chain grown from empty: a group keeps its
        predecessor's members in place and appends the added ones node by node, by index."""
        out: list[tuple[int, ...]] = []
        prev, members = self.root, ()
        for g in chain:
            added: list[int] = []
            grown = g.used
            while grown:
                low = grown & -grown
                p = low.bit_length() - 1
                grown ^= low
                c0 = (prev.cnt if p == prev.part else len(self.nodeq[p])) \
                    if prev.used >> p & 1 else 0
                c1 = g.cnt if p == g.part else len(self.nodeq[p])
                if c1 > c0:
                    added.extend(sorted(self.by_node(p)[c0:c1]))
            members = members + tuple(added)
            out.append(members)
            prev = g
        return out

    def by_node(self, p: int) -> list[int]:
        """Node position ``p``'s instances by queue time (a stable sort: ties by index)."""
        inst = self._by_node.get(p)
        if inst is None:
            inst = self._by_node[p] = sorted(self.topology[p][1], key=self.queue.__getitem__)
        return inst
