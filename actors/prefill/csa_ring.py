"""CSA in the ring (CSPS §3.2.4, Eq. 5): far KV is cut to the tokens CSA keeps before it is sent.

LOSSY unless every drop ratio is 0; opt-in (``[csa] enabled``, ``ChunkTask.csa_drop_ratios``).
The levels are those of ``kernels/csa.py`` with each ring member's block (its history share
and its zigzag share of the chunk) as its shard: a query sees its own block at level 1, the
blocks of members on its node at level 2, the others' at level 3 (``CsaLayout.level``), each
causally by position. A member ranks its block's tokens per KV head by the attention its own
queries gave them in the previous layer's level 1 (local, notes §1.7.4; layer 0 and the last
layer stay dense, as in ``engine/csa_prefill.py``), and level v keeps the first
``kept_count(n, p_v)`` of the ranking: nested keep sets.

What moves. Block ``src`` travels ``src → src+1 → … → src+s−1``. A hop carries the block's
rows in rank order, cut to the most any member still ahead of it keeps (the ranking is
shared, so every later member's keep set is a prefix of what it receives), with the rows'
positions (int32, [m, Hkv]: a row of one KV head is a token of that head's ranking). Sizes
follow from the plan's block sizes, the members' nodes and the ratios, so receivers size their
buffers without a handshake, as the dense ring does. ``sent_elements`` counts the KV elements
sent, ``sent_index_elements`` the positions, ``inter_node_elements`` the KV crossing nodes.

The receiver attends per level with its own queries kept at that level (``drop_queries``,
the paper's rule; False keeps every query: KV only) and merges the levels by their softmax
denominators, Eq. 5 in log-sum-exp form. With every ratio 0 this is the dense ring.
"""

from __future__ import annotations

import torch
from tetris.actors.prefill.ring import RingAttention, partial_attention, ring_source
from tetris.actors.prefill.world import PeerLink
from tetris.kernels.csa import (
    CsaLayout,
    kept_count,
    key_importance,
    masked_attention_with_lse,
    rank_order,
)
from tetris.kernels.merge import merge_attention, merge_attention_all

__all__ = ["CsaRingAttention"]


class CsaRingAttention(RingAttention):
    """One member's CSA ring for one chunk. ``member_nodes``: the members' nodes in ring
    order; ``drop_ratios``: (p1, p2, p3) with p1 = 0; ``num_layers``: the model's (the last
    layer stays dense)."""

    def __init__(self, group: tuple[int, ...], rank: int, block_positions: list[torch.Tensor],
                 tag: int, timeout_s: float, link: PeerLink | None = None, *,
                 member_nodes: tuple[int, ...], drop_ratios: tuple[float, ...],
                 num_layers: int, drop_queries: bool = True) -> None:
        super().__init__(group, rank, block_positions, tag, timeout_s, link)
        if len(member_nodes) != len(group) or len(drop_ratios) != 3 or drop_ratios[0]:
            raise ValueError(f"CSA ring: need one node per member and (0, p2, p3), got "
                             f"{member_nodes} and {drop_ratios}")
        self.levels = CsaLayout.of_owners((), member_nodes)   # levels by member only
        self.drop_ratios = tuple(drop_ratios)
        self.num_layers = num_layers
        self.drop_queries = drop_queries
        self.sent_index_elements = 0
        self.inter_node_elements = 0
        self._importance: torch.Tensor | None = None   # [n_r, Hkv], previous layer's

    def _drops(self, layer: int) -> bool:
        return 0 < layer < self.num_layers - 1

    def __call__(self, q, q_pos, k_block, v_block, layer: int = 0, scale=None):
        """As ``RingAttention``: q [Tq, Hq, D] at q_pos, this member's block k, v [n, Hkv, D]."""
        if self._drops(layer):
            out = self._csa_layer(q, q_pos, k_block, v_block, layer, scale)
        else:
            before = self.sent_elements
            out = super().__call__(q, q_pos, k_block, v_block, layer, scale)
            if self._next_off_node():
                self.inter_node_elements += self.sent_elements - before
            if self._drops(layer + 1):
                self._importance = self._level1(q, q_pos, k_block, v_block, scale)[2]
        return out

    def _next_off_node(self) -> bool:
        nodes = self.levels.shard_nodes
        return nodes[(self.rank + 1) % self.sp_size] != nodes[self.rank]

    def _level1(self, q, q_pos, k, v, scale):
        """Attention over the own block (level 1, causal by position) with the key importance
        [n, Hkv] it gives the next layer."""
        k_pos = self.block_positions[self.rank]
        visible = (k_pos[None, :] <= q_pos[:, None]).unsqueeze(0).expand(q.shape[1], -1, -1)
        out, lse, probs = masked_attention_with_lse(q, k, v, visible, scale)
        return out, lse, key_importance(probs, k.shape[1])

    def _rows_ahead(self, src: int, hop: int) -> int:
        """Rows of ``src``'s block the hop arriving at member src+hop carries: the most any
        member from there to the end of the block's trip (src+s−1) keeps."""
        s = self.sp_size
        n = self.block_positions[src].numel()
        return max(kept_count(n, self.drop_ratios[self.levels.level(src, (src + j) % s) - 1])
                   for j in range(hop, s))

    def _csa_layer(self, q, q_pos, k_block, v_block, layer: int, scale):
        s, r = self.sp_size, self.rank
        pos = self.block_positions[r]
        out1, lse1, importance = self._level1(q, q_pos, k_block, v_block, scale)
        order = rank_order(self._importance)                        # [n, Hkv]
        # my block in rank order: row i of KV head g is that head's i-th most important token
        kv = torch.stack([k_block, v_block], dim=1)                  # [n, 2, Hkv, D]
        idx = order[:, None, :, None].expand(-1, 2, -1, kv.shape[-1])
        cur = (torch.gather(kv, 0, idx), pos[order].to(torch.int32))
        q_keep = self._query_keep(order, q_pos)
        levels = {1: (out1, lse1)}
        for t in range(1, s):
            works, cur = self._post_csa_step(cur, t - 1)
            self._wait(works, layer, t - 1)
            src = ring_source(r, t, s)
            v_lvl = self.levels.level(src, r)
            n_keep = kept_count(self.block_positions[src].numel(), self.drop_ratios[v_lvl - 1])
            part = self._attend_kept(q, q_pos, cur, n_keep, q_keep[v_lvl - 1], scale)
            prev = levels.get(v_lvl)
            levels[v_lvl] = part if prev is None else merge_attention(*prev, *part)
        if self._drops(layer + 1):
            self._importance = importance
        return merge_attention_all([levels[v] for v in sorted(levels)])[0]   # Eq. 5

    def _query_keep(self, order, q_pos) -> list[torch.Tensor]:
        """Per level, [Tq, Hkv] bool: my queries kept at that level (all, with KV-only CSA)."""
        pos = self.block_positions[self.rank]
        n, hkv = order.shape
        at = torch.searchsorted(pos, q_pos)   # each query's row in my block
        keeps = []
        for p in self.drop_ratios:
            keep = torch.zeros(n, hkv, dtype=torch.bool)
            keep.scatter_(0, order[:kept_count(n, p)], True)
            keeps.append(keep[at] if self.drop_queries else torch.ones_like(keep[at]))
        return keeps

    def _post_csa_step(self, cur, step: int):
        """Send my held block, cut to what the members ahead keep, to r+1; receive block
        (r−step−1), cut likewise, from r−1."""
        s, r = self.sp_size, self.rank
        kv, kpos = cur
        out_rows = self._rows_ahead(ring_source(r, step, s), step + 1)
        sends = []
        if out_rows:
            kv_out = kv[:out_rows].contiguous()
            pos_out = kpos[:out_rows].contiguous()
            nxt = self.group[(r + 1) % s]
            sends = [(kv_out, nxt), (pos_out, nxt)]   # posted in this order on both sides
            self.sent_elements += kv_out.numel()
            self.sent_index_elements += pos_out.numel()
            if self._next_off_node():
                self.inter_node_elements += kv_out.numel()
        incoming = ring_source(r, step + 1, s)
        in_rows = self._rows_ahead(incoming, step + 1)
        nxt_kv = kv.new_empty((in_rows, *kv.shape[1:]))
        nxt_pos = kpos.new_empty((in_rows, kpos.shape[1]))
        prev = self.group[(r - 1) % s]
        recvs = [(nxt_kv, prev), (nxt_pos, prev)] if in_rows else []
        return self.link.exchange(sends, recvs, self.tag), (nxt_kv, nxt_pos)

    def _attend_kept(self, q, q_pos, cur, n_keep: int, q_keep, scale):
        """My queries (those kept, per KV head) against the first ``n_keep`` ranked rows of a
        received block: (out [Tq, Hq, D], lse [Hq, Tq]); a dropped query has lse −inf."""
        kv, kpos = cur
        tq, hq, _ = q.shape
        hkv = kv.shape[2]
        group = hq // hkv
        out = torch.zeros_like(q)
        lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
        for g in range(hkv):
            heads = slice(g * group, (g + 1) * group)
            by_pos = torch.argsort(kpos[:n_keep, g])
            k_pos = kpos[:n_keep, g][by_pos].long()
            rows = q_keep[:, g].nonzero().flatten()
            if rows.numel() == 0 or n_keep == 0:
                continue
            o, l = partial_attention(q[rows][:, heads], q_pos[rows],
                                     kv[:n_keep, 0, g][by_pos].unsqueeze(1),
                                     kv[:n_keep, 1, g][by_pos].unsqueeze(1), k_pos, scale=scale)
            out[rows, heads] = o
            lse[heads][:, rows] = l
        return out, lse
