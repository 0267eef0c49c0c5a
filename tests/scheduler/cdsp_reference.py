"""The CDSP search as it was before the speed-up of this session (cdsp.py + extend.py at
commit c77af12), kept verbatim as the reference that the faster search must match plan for
plan (test_search_speedup.py). Not used by the package.
"""

from __future__ import annotations

import math
from typing import Sequence

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
            takes[n] = min(need, len(by_node[n]) - counts[n])
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


# A chunk under construction: (tokens, group, start, end, next chunk).
_Link = tuple


class SearchResult:
    """A plan: ``chunks`` as (tokens, members, start, end) in absolute times, and the TTFT."""

    __slots__ = ("ttft", "chunks")

    def __init__(self, ttft: float, chunks: list[tuple[int, tuple[int, ...], float, float]]):
        self.ttft = ttft
        self.chunks = chunks


class CdspSearch:
    """One decision's search state: coefficients, candidate SP sizes and a group builder."""

    __slots__ = ("coeffs", "sizes", "groups", "now", "theta", "min_chunk", "align")

    def __init__(self, coeffs: dict[int, tuple[float, float, float, float]],
                 sizes: Sequence[int], queue: Sequence[float],
                 topology: list[tuple[int, list[int]]], now: float,
                 *, theta: float, min_chunk_tokens: int, chunk_align: int):
        self.coeffs = coeffs
        self.sizes = tuple(sizes)
        self.groups = GroupBuilder(queue, topology)
        self.now = now
        self.theta = theta
        self.min_chunk = max(1, min_chunk_tokens)
        self.align = max(1, chunk_align)

    # ---- Algorithm 2 ----------------------------------------------------------------------

    def single_chunk(self, remaining: int, history: int, g_prev: Group,
                     t_prev: float, lo: int) -> tuple[float, int, float]:
        """Best single chunk from size index ``lo``: (end, size index, start)."""
        sizes, coeffs, theta, now = self.sizes, self.coeffs, self.theta, self.now
        children, child = g_prev.children, self.groups.child
        best_ttft = math.inf
        best_k = -1
        best_start = 0.0
        for k in range(lo, len(sizes)):
            s = sizes[k]
            g = children.get(s) or child(g_prev, s)
            mq = g.max_queue
            start = t_prev if t_prev > mq else mq
            a, b, g, d = coeffs[s]
            ttft = start + a + remaining * (b + g * history + d * remaining)
            # A larger SP size must gain more than θ of the best TTFT so far (SPEC §3);
            # TTFTs count from the arrival, hence `- now`.
            if best_k < 0 or best_ttft - ttft > theta * (best_ttft - now):
                best_ttft, best_k, best_start = ttft, k, start
        return best_ttft, best_k, best_start

    def single_chunk_plan(self, prompt_tokens: int) -> SearchResult:
        root = self.groups.root
        ttft, k, start = self.single_chunk(prompt_tokens, 0, root, self.now, 0)
        return self._result(ttft, (prompt_tokens, self.groups.child(root, self.sizes[k]), start,
                                   ttft, None))

    def options(self, prompt_tokens: int) -> list[tuple[int, tuple[int, ...], float, float]]:
        """Every single-chunk alternative: (sp, members, start, end), for explaining a plan."""
        out = []
        for s in self.sizes:
            g = self.groups.group((s,))
            start = max(self.now, g.max_queue)
            a, b, _, d = self.coeffs[s]
            out.append((s, g.members, start, start + a + prompt_tokens * (b + d * prompt_tokens)))
        return out

    # ---- Algorithms 1 and 3 ---------------------------------------------------------------

    def plan(self, prompt_tokens: int) -> SearchResult:
        ttft, head = self._cdsp(prompt_tokens, 0, self.groups.root, self.now, 0, math.inf)
        return self._result(ttft, head)

    def _cdsp(self, remaining: int, history: int, g_prev: Group, t_prev: float,
              lo: int, bound: float) -> tuple[float, _Link]:
        best_ttft, k_max, start = self.single_chunk(remaining, history, g_prev, t_prev, lo)
        best: _Link = (remaining, g_prev.children[self.sizes[k_max]], start, best_ttft, None)
        if k_max == lo:  # one candidate left up to s_max: no pair to chunk with
            return best_ttft, best
        sizes, coeffs, child = self.sizes, self.coeffs, self.groups.child
        min_chunk, align = self.min_chunk, self.align
        for i in range(lo, k_max):
            s_cur = sizes[i]
            g_cur = g_prev.children[s_cur]  # built by single_chunk above
            mq_cur = g_cur.max_queue
            start_cur = t_prev if t_prev > mq_cur else mq_cur
            a, b, g, d = coeffs[s_cur]
            lin = b + g * history
            for j in range(i + 1, k_max + 1):
                # Algorithm 3: the budget is the wait until the larger group is free.
                s_next = sizes[j]
                mq_next = (g_cur.children.get(s_next) or child(g_cur, s_next)).max_queue
                budget = (t_prev if t_prev > mq_next else mq_next) - start_cur - a
                if budget <= 0.0:
                    continue
                tokens = 2.0 * budget / (lin + math.sqrt(lin * lin + 4.0 * d * budget))
                tokens = int(tokens // align) * align
                if tokens < min_chunk or tokens >= remaining:
                    continue
                end = start_cur + a + tokens * (lin + d * tokens)
                cut = bound if bound < best_ttft else best_ttft
                if end >= cut:
                    continue
                # Eq. 2: every member of G_cur is busy until this chunk's end.
                rest_ttft, rest = self._cdsp(remaining - tokens, history + tokens, g_cur,
                                             end, j, cut)
                if rest_ttft < best_ttft:
                    best_ttft = rest_ttft
                    best = (tokens, g_cur, start_cur, end, rest)
        return best_ttft, best

    def _result(self, end: float, link: _Link | None) -> SearchResult:
        chunks = []
        while link is not None:
            tokens, group, start, chunk_end, link = link
            chunks.append((tokens, group.members, start, chunk_end))
        return SearchResult(end - self.now, chunks)
