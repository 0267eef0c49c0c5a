"""SP-TP with hierarchical collectives (CSPS §3.2.3 "hierarchical communication", notes §1.8):
the all-gather and the reduce-scatter cross each pair of nodes once, not once per pair of
members.

Members sit on nodes (``member_nodes[j]``); each node's first member in group order is its
*leader*. All-gather of the hidden rows, in three steps:

1. inside each node, every member sends its rows to the others (with, to every member on any
   node, its history KV of that member's heads: destination-specific, so sent directly);
2. each leader sends its node's rows (its members', in member order) to every other leader;
3. each leader forwards the other nodes' rows to its members.

Reduce-scatter of the o_proj partials, in three steps:

1. inside each node, every member sends each node peer that peer's partial rows, and sends its
   leader the partial rows of every member on other nodes (in one message with the leader's own
   rows); the leader sums them in member order: the node's partial for each remote member;
2. each leader sends every other leader the node sums for that leader's members;
3. each leader forwards each member its rows of every other node's sum.

A member's result is its node's partials summed in member order plus the other nodes' sums in
node order: deterministic, the same terms as the flat reduce-scatter in another order (within
fp32 rounding). Inter-node elements per layer drop from ``2·l·d·Σ_a n_a·(N − G_a)/…`` (every
member pair across nodes) to one copy per node pair: by the node size ``G`` for equal nodes.
``inter_node_elements`` counts them. With one NIC per member, though, the leader's bundle
takes as long on its NIC as the flat sends on every member's NIC: it saves bytes, not time.
``RailSpTp`` (nodes of equal size) spreads the same inter-node bytes over every NIC of a node;
``hierarchical_sptp`` picks rails where it can. The executor runs them for an ``sptp`` chunk
whose members (``ChunkTask.sp_member_nodes``) span nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tetris.actors.prefill.sptp import SpTpAttention

__all__ = ["HierarchicalSpTp", "RailSpTp", "hierarchical_sptp"]


class HierarchicalSpTp(SpTpAttention):
    """``SpTpAttention`` whose two collectives go intra-node first (module docstring)."""

    def __init__(self, *args, member_nodes: Sequence[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if len(member_nodes) != self.sp_size:
            raise ValueError(f"member_nodes has {len(member_nodes)} entries for a group of "
                             f"{self.sp_size}")
        order: dict[int, list[int]] = {}
        for j, node in enumerate(member_nodes):
            order.setdefault(node, []).append(j)
        self.nodes = list(order.values())                 # first-seen node order
        self.node_of = [0] * self.sp_size
        for a, members in enumerate(self.nodes):
            for j in members:
                self.node_of[j] = a
        self.inter_node_elements = 0

    # ---- plumbing ----

    def _mine(self) -> tuple[int, list[int], bool]:
        a = self.node_of[self.rank]
        return a, self.nodes[a], self.nodes[a][0] == self.rank

    def _n(self, j: int) -> int:
        return self.query_positions[j].numel()

    def _talk(self, sends, recvs, dtype, layer: int, which: int) -> dict[int, torch.Tensor]:
        """sends [(tensor, member)], recvs [(elements, member)] -> {member: received}."""
        device = sends[0][0].device if sends else torch.device("cpu")
        bufs = {j: torch.empty(n, dtype=dtype, device=device) for n, j in recvs if n}
        out = [(t.contiguous(), self.group[j]) for t, j in sends if t.numel()]
        works = self.link.exchange(out, [(b, self.group[j]) for j, b in bufs.items()], self.tag)
        for t, j in sends:
            self.sent_elements += t.numel()
            if self.node_of[j] != self.node_of[self.rank]:
                self.inter_node_elements += t.numel()
        self._await(works, f"hierarchical SP-TP step {which} of layer {layer}")
        return {j: bufs.get(j, torch.empty(0, dtype=dtype)) for _, j in recvs}

    # ---- all-gather ----

    def all_gather(self, hidden, hist_out, my_kh: int, d: int, layer: int):
        s, r, width, dt = self.sp_size, self.rank, hidden.shape[1], hidden.dtype
        a, local, leader = self._mine()
        flat = hidden.reshape(-1)
        hist_n = [self.history_positions[j].numel() * 2 * my_kh * d for j in range(s)]
        sends, recvs = [], []
        for j in range(s):
            if j == r:
                continue
            near = self.node_of[j] == a
            sends.append((torch.cat((flat, hist_out[j].reshape(-1))) if near
                          else hist_out[j].reshape(-1), j))
            recvs.append(((self._n(j) * width if near else 0) + hist_n[j], j))
        got = self._talk(sends, recvs, dt, layer, 1)
        rows = {r: hidden}
        hist_kv = {r: hist_out[r]}
        for j, m in got.items():
            near = self.node_of[j] == a
            cut = self._n(j) * width if near else 0
            if near:
                rows[j] = m[:cut].view(-1, width)
            hist_kv[j] = m[cut:].view(-1, 2, my_kh, d)
        remote = [j for b, members in enumerate(self.nodes) if b != a for j in members]
        if leader:   # step 2: node bundles between leaders
            mine = torch.cat([rows[j].reshape(-1) for j in local])
            got = self._talk([(mine, self.nodes[b][0]) for b in range(len(self.nodes)) if b != a],
                             [(sum(self._n(j) for j in self.nodes[b]) * width, self.nodes[b][0])
                              for b in range(len(self.nodes)) if b != a], dt, layer, 2)
            for b in range(len(self.nodes)):
                if b != a:
                    parts = got[self.nodes[b][0]].split([self._n(j) * width for j in self.nodes[b]])
                    rows.update({j: p.view(-1, width) for j, p in zip(self.nodes[b], parts)})
            fwd = torch.cat([rows[j].reshape(-1) for j in remote]) if remote else flat[:0]
            self._talk([(fwd, j) for j in local if j != r], [], dt, layer, 3)
        else:        # step 3: the other nodes' rows from my leader
            got = self._talk([], [(sum(self._n(j) for j in remote) * width, local[0])], dt, layer, 3)
            parts = got[local[0]].split([self._n(j) * width for j in remote])
            rows.update({j: p.view(-1, width) for j, p in zip(remote, parts)})
        return (torch.cat([rows[j] for j in range(s)]),
                [hist_kv[j] for j in range(s)])

    # ---- reduce-scatter ----

    def reduce_scatter(self, partial, n_mine: int, layer: int):
        r, width, dt = self.rank, partial.shape[1], partial.dtype
        a, local, leader = self._mine()
        remote = [j for b, members in enumerate(self.nodes) if b != a for j in members]
        bundle = [partial[self.rows_of[t]] for t in remote]       # my partials for remote rows
        sends, recvs = [], []
        for t in local:
            if t == r:
                continue
            msg = partial[self.rows_of[t]].reshape(-1)
            if t == local[0]:   # the leader also gets what I owe the other nodes
                msg = torch.cat([msg] + [x.reshape(-1) for x in bundle])
            sends.append((msg, t))
            extra = sum(self._n(j) for j in remote) if leader else 0
            recvs.append(((n_mine + extra) * width, t))
        got = self._talk(sends, recvs, dt, layer, 1)
        parts = {r: partial[self.rows_of[r]]}
        # a leader's running node sums for the remote members (its own bundle first)
        sums = torch.cat([x.reshape(-1) for x in bundle] + [partial.new_empty(0)])
        for t in local:         # member order
            if t != r:
                parts[t] = got[t][:n_mine * width].view(-1, width)
                if leader:
                    sums += got[t][n_mine * width:]
        total = parts[local[0]].clone()
        for t in local[1:]:     # my node's partials, member order
            total += parts[t]
        if leader:
            return self._leaders_exchange(total, sums, remote, width, dt, layer)
        n_other = len(self.nodes) - 1
        got = self._talk([], [(n_other * n_mine * width, local[0])], dt, layer, 3)
        for x in got[local[0]].view(n_other, -1) if n_other and n_mine else ():   # node order
            total += x.view(-1, width)
        return total

    def _leaders_exchange(self, total, sums, remote, width, dt, layer):
        """Steps 2 and 3 of the reduce-scatter on a leader; returns its own rows' sum."""
        a, local, _ = self._mine()
        offsets, at = {}, 0
        for t in remote:
            offsets[t] = (at, at + self._n(t) * width)
            at += self._n(t) * width
        others = [b for b in range(len(self.nodes)) if b != a]
        sends = [(torch.cat([sums[slice(*offsets[t])] for t in self.nodes[b]]), self.nodes[b][0])
                 for b in others]
        recvs = [(sum(self._n(t) for t in local) * width, self.nodes[b][0]) for b in others]
        got = self._talk(sends, recvs, dt, layer, 2)
        per_node = [got[self.nodes[b][0]].split([self._n(t) * width for t in local])
                    for b in others]                 # node order, then my node's members
        for piece in per_node:
            total += piece[0].view(-1, width)        # piece[0]: the leader's own rows
        fwd = [(torch.cat([piece[k] for piece in per_node]), t)
               for k, t in enumerate(local) if k > 0]
        self._talk(fwd, [], dt, layer, 3)
        return total


def hierarchical_sptp(*args, member_nodes: Sequence[int], **kwargs) -> HierarchicalSpTp:
    """Rails where every node holds as many members, else one leader per node."""
    counts = {n: list(member_nodes).count(n) for n in member_nodes}
    cls = RailSpTp if len(set(counts.values())) == 1 else HierarchicalSpTp
    return cls(*args, member_nodes=member_nodes, **kwargs)


class RailSpTp(HierarchicalSpTp):
    """Hierarchical SP-TP over *rails*, for nodes of equal size ``G``: member ``i`` of a node
    talks across nodes only to member ``i`` of every other node, so the inter-node bytes are
    the leader scheme's but spread over the ``G`` NICs of a node.

    All-gather: (1) each member sends its rows along its rail to the other ``k−1`` nodes; (2)
    inside the node, each member sends every peer its own rows and those its rail brought.
    Reduce-scatter: (1) inside the node, member ``i`` sends peer ``p`` its partial rows of the
    rail-``p`` members of every node; ``p`` sums them in member order (the node's sum for its
    rail); (2) along the rail, member ``p`` sends each other node's rail-``p`` member the sum
    for its rows; each member adds the ``k`` node sums in node order. History KV goes directly.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if len({len(m) for m in self.nodes}) != 1:
            raise ValueError("rails need nodes of equal size")

    def _rail(self, j: int) -> list[int]:
        """Members on member ``j``'s rail (the same index in every node), in node order."""
        i = self.nodes[self.node_of[j]].index(j)
        return [members[i] for members in self.nodes]

    def all_gather(self, hidden, hist_out, my_kh: int, d: int, layer: int):
        s, r, width, dt = self.sp_size, self.rank, hidden.shape[1], hidden.dtype
        _, local, _ = self._mine()
        flat = hidden.reshape(-1)
        rail = self._rail(r)
        hist_n = [self.history_positions[j].numel() * 2 * my_kh * d for j in range(s)]
        # step 1: rows along the rail, and every member's history KV directly
        sends, recvs = [], []
        for j in range(s):
            if j == r:
                continue
            on_rail = j in rail
            sends.append((torch.cat((flat, hist_out[j].reshape(-1))) if on_rail
                          else hist_out[j].reshape(-1), j))
            recvs.append(((self._n(j) * width if on_rail else 0) + hist_n[j], j))
        got = self._talk(sends, recvs, dt, layer, 1)
        rows, hist_kv = {r: hidden}, {r: hist_out[r]}
        for j, m in got.items():
            cut = self._n(j) * width if j in rail else 0
            if cut:
                rows[j] = m[:cut].view(-1, width)
            hist_kv[j] = m[cut:].view(-1, 2, my_kh, d)
        # step 2: inside the node, my rail's rows (node order) to every peer
        mine = torch.cat([rows[j].reshape(-1) for j in rail])
        peers = [p for p in local if p != r]
        got = self._talk([(mine, p) for p in peers],
                         [(sum(self._n(j) for j in self._rail(p)) * width, p) for p in peers],
                         dt, layer, 2)
        for p, m in got.items():
            members = self._rail(p)
            for j, part in zip(members, m.split([self._n(j) * width for j in members])):
                rows[j] = part.view(-1, width)
        return torch.cat([rows[j] for j in range(s)]), [hist_kv[j] for j in range(s)]

    def reduce_scatter(self, partial, n_mine: int, layer: int):
        r, width, dt = self.rank, partial.shape[1], partial.dtype
        _, local, _ = self._mine()
        # step 1: to each node peer p, my partial rows of p's rail (node order)
        peers = [p for p in local if p != r]
        sends = [(torch.cat([partial[self.rows_of[j]].reshape(-1) for j in self._rail(p)]), p)
                 for p in peers]
        need = sum(self._n(j) for j in self._rail(r)) * width
        got = self._talk(sends, [(need, p) for p in peers], dt, layer, 1)
        mine = {r: torch.cat([partial[self.rows_of[j]].reshape(-1) for j in self._rail(r)]
                             + [partial.new_empty(0)])}
        mine.update(got)
        node_sum = mine[local[0]].clone()
        for p in local[1:]:     # member order
            node_sum += mine[p]
        # step 2: along my rail, each node's rail member gets this node's sum for its rows
        rail = self._rail(r)
        cuts = [self._n(j) * width for j in rail]
        pieces = dict(zip(rail, node_sum.split(cuts)))
        got = self._talk([(pieces[j], j) for j in rail if j != r],
                         [(n_mine * width, j) for j in rail if j != r], dt, layer, 2)
        total = None
        for j in rail:          # node order
            x = (pieces[r] if j == r else got[j]).view(-1, width)
            total = x.clone() if total is None else total + x
        return total
