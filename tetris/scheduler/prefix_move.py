"""Moving a cached prefix's KV to a first group without its holders (issue #23 item 2, "move").

A hit's prefix ``[0, c)`` lies on the holders ``H`` (the source run's last group). ``extend``
(prefix_plan.py) makes ``H`` the start of the first group; when ``H`` is busy, a group ``G``
of free instances can start sooner if the prefix's KV is moved to it first. The holders send
from their transfer thread while they compute something else (as they stream KV to decode),
so the move starts as soon as the source run's prefill has finished (``ready``) and ``G``'s
first chunk starts no earlier than ``ready + move_seconds``.

Price (``PrefixMove.seconds``): the prefix's KV is ``c · L · 2 · Hkv · d_h · b`` bytes per
instance (all layers, K and V; the per-instance geometry of the CSPS cost model,
``sp_comm.ModelGeometry``, so a TP rank moves its head slice over its own NIC). Each holder
holds ``1/|H|`` of it and every receiver ends with ``1/|G|`` (spread evenly over ``G`` in ring
order), so each holder-receiver pair carries ``bytes / (|H|·|G|)``. Every instance sends (or
receives) its intra- and inter-node pairs at once over its own links (``sp_comm.CommLinks``,
as ``_spread`` prices an all-to-all): its time is the longer of the two kinds, and the move
takes the slowest instance of either side, plus one message latency. All on one node: the
intra-node link; ``H`` and ``G`` on different nodes: the inter-node NIC.

Search (``move_search``): Algorithms 1-3 (cdsp.py) over the pool without ``H``, the prefix as
history, once per candidate first-group size ``s``: the first group ``G_s`` is rule 1's
(extend.py) group of ``s`` over that pool and the first chunk starts no earlier than
``ready + seconds(G_s)``. The search may grow ``G_s`` in the first chunk; such a plan is kept
only when the move to its actual first group still lands before that chunk starts (else it
is priced in its own size's turn), so every plan returned is exact for the group it names.

Pure: no torch, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tetris.scheduler.cdsp import CdspSearch, SearchResult
from tetris.scheduler.extend import node_members
from tetris.scheduler.pool import PoolState
from tetris.scheduler.sp_comm import CommLinks, ModelGeometry

__all__ = ["MoveResult", "PrefixMove", "move_search"]


class PrefixMove:
    """The link model a move is priced on: per-instance geometry and links."""

    __slots__ = ("geometry", "links")

    def __init__(self, geometry: ModelGeometry, links: CommLinks) -> None:
        self.geometry = geometry
        self.links = links

    @classmethod
    def from_chooser(cls, chooser) -> PrefixMove:
        """The CSPS layout chooser's own geometry and deployment links (sp_comm.LayoutChooser)."""
        return cls(chooser.geometry, chooser.links)

    @classmethod
    def from_deployment(cls, deployment) -> PrefixMove:
        """The deployment's model (per prefill instance's TP rank) and its ``[sp_layout]``
        links, the numbers the layout chooser would use."""
        return cls(ModelGeometry.from_model_config(deployment.model, deployment.prefill.tp_size),
                   CommLinks.from_config(deployment.sp_layout))

    def kv_bytes(self, tokens: int) -> float:
        """Bytes of ``tokens`` tokens' KV on one instance (one TP rank): all layers, K and V."""
        g = self.geometry
        return float(tokens * g.num_layers * 2 * g.num_kv_heads * g.head_dim
                     * self.links.bytes_per_element)

    def seconds(self, tokens: int, holders: Sequence[int], receivers: Sequence[int],
                node_of: Sequence[int]) -> float:
        """When the move of ``tokens`` tokens' KV from ``holders`` to ``receivers`` has landed,
        counted from its start (module docstring)."""
        if not holders or not receivers:
            raise ValueError("a move needs holders and receivers")
        pair = self.kv_bytes(tokens) / (len(holders) * len(receivers))
        worst = max(self._side(x, receivers, pair, node_of) for x in holders)
        worst = max(worst, max(self._side(x, holders, pair, node_of) for x in receivers))
        return worst + self.links.message_latency_s

    def _side(self, member: int, peers: Sequence[int], pair: float,
              node_of: Sequence[int]) -> float:
        """One instance's sends (or receives) to ``peers``: both link kinds at once."""
        near = sum(1 for p in peers if node_of[p] == node_of[member])
        far = len(peers) - near
        return max(near * pair / self.links.intra_node, far * pair / self.links.inter_node)


class MoveResult:
    """The best moved plan's chunks (pool indices, absolute times), its TTFT and the move."""

    __slots__ = ("move_s", "result")

    def __init__(self, result: SearchResult, move_s: float) -> None:
        self.result = result
        self.move_s = move_s


def move_search(policy, prompt_tokens: int, cached: int, holders: Sequence[int], now: float,
                ready: float, pool: PoolState, theta: float,
                move: PrefixMove) -> MoveResult | None:
    """The best plan whose first group is free of ``holders`` and receives the prefix's KV,
    moved from ``ready`` on; None when no profile SP size fits the pool without them."""
    held = set(holders)
    rest = [i for i in range(pool.size) if i not in held]
    sizes = [s for s in policy.sp_candidates if s <= len(rest)]
    if not sizes:
        return None
    search = CdspSearch(policy.profile.table, sizes, [pool.queue_times[i] for i in rest],
                        node_members([pool.node_of[i] for i in rest]), now, theta=theta,
                        min_chunk_tokens=policy.min_chunk_tokens, chunk_align=policy.chunk_align)
    groups, remaining = search.groups, prompt_tokens - cached
    best: MoveResult | None = None
    for k, s in enumerate(sizes):
        first = groups.child(groups.root, s)
        receivers = [rest[m] for m in groups.ring([first])[0]]
        floor = ready + move.seconds(cached, holders, receivers, pool.node_of)
        if policy.chunked:
            end, head = search._cdsp(remaining, cached, first, floor, k, math.inf)
        else:
            end, kk, start = search.single_chunk(remaining, cached, first, floor, k)
            head = (remaining, groups.child(first, sizes[kk]), start, end, None)
        res = search._result(end, head)
        chunks = [(tokens, tuple(rest[m] for m in members), start, chunk_end)
                  for tokens, members, start, chunk_end in res.chunks]
        move_s = move.seconds(cached, holders, chunks[0][1], pool.node_of)
        if chunks[0][2] < ready + move_s:
            continue   # grown past G_s and landing later there: its own size's turn prices it
        if best is None or res.ttft < best.result.ttft:
            best = MoveResult(SearchResult(res.ttft, chunks), move_s)
    return best
