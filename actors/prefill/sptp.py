"""SP-TP for a chunk group: Megatron-SP all-gather before attention, reduce-scatter after
(CSPS §3.2.1, Fig. 4b; notes §1.3).

The group of ``s`` members acts, for the attention block, as one tensor-parallel group of ``s``
with the chunk's sequence sharded over it (SP degree = TP degree, the paper's SP-TP). Every
member holds the whole model here (TP-1 instances), so no weights move: member ``j`` uses the
row slice of ``W_QKV`` and the column slice of ``W_L`` (``o_proj``) of its head shard, as a TP
rank holds them. Per layer, member ``r`` (zigzag share of ``n_r`` rows, KV block as under the
ring):

1. **All-gather** (with history): member ``r`` sends every member its ``n_r`` hidden rows
   (``[n_r, d]``, the layer input) and, to member ``j``, the history rows of its KV block for
   the KV heads ``j`` reads. **History decision**: the history is sequence-sharded over the
   members (cache balancing), and a head-sharded member must see every history key of its heads;
   the paper's SP-TP has no history, and sending the stored KV per head shard costs
   ``(s−1)/s · h · 2·Hkv/s·d_h`` per member, as under SP-NTP (alltoall.py).
2. Member ``j`` computes Q, K, V of its heads for the whole chunk from the gathered rows
   (input RMSNorm, its ``W_QKV`` rows, RoPE at the rows' positions), attends ``[start, end)``
   to ``[0, end)`` for its heads, and applies its ``W_L`` columns: a partial ``O^j W_L^j``
   ``[l, d]``.
3. **Reduce-scatter**: member ``j`` sends each member the partial rows of that member's
   queries; member ``r`` sums the ``s`` partials in member order (deterministic) and adds the
   residual: ``O_L = Σ_j O^j W_L^j`` for its share.

The stored KV does not change: each member still writes the KV of its own share, all KV heads,
from its own rows (the executor's projection), so the hand-off, cache balancing and the other
layouts see the same store; recomputing the chunk's K, V of its heads costs member ``j`` a
second, ``1/s``-wide projection of the chunk, not communication. KV heads are replicated when
the group is larger than ``Hkv`` (head_shards.py): a shared KV head is projected by each of its
members, and its history sent to each. The MLP runs on the member's own rows with full weights
(the paper leaves SP-TP's MLP open, notes §1.3). Volume per layer over the group at ``h = 0``:
``2·l·d·(s−1)`` (Appendix A), measured by ``sent_elements``.

**Members that are TP > 1 instances** (tp.py). TP rank ``t`` of an instance holds head slice
``t`` (``Hq/T`` query heads, ``Hkv/T`` KV heads, the matching ``o_proj`` columns) and the whole
hidden rows of its instance's share. SP-TP then runs once per head slice, between the TP ranks
``t`` of the group's instances (the slice's world, as the ring does): member ``j`` of slice ``t``
takes head shard ``j`` of the slice's heads (``head_shard_slices`` over the local counts), the
all-gather carries the full ``d``-wide rows, and the reduce-scatter leaves member ``r`` with
``Σ_j O^{t,j} W_L^{t,j}``: slice ``t``'s part of ``O_L`` only. The instance's TP all-reduce
(its ``o_proj`` group) then adds the ``T`` slices: ``O_L = Σ_t Σ_j O^{t,j} W_L^{t,j}``, the
row-parallel sum the TP-1 ``o_proj`` makes in one step. It runs after the reduce-scatter, on
the member's ``n_r`` rows (``2·(T−1)/T·n_r·d`` per rank, inside the instance), not on the
``l`` rows of the partial before it. Per slice world the volume is the TP-1 one with the full
``d`` (every slice gathers the same rows): ``T`` times the group's hidden traffic, each slice
on its own rank's links.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tetris.actors.prefill.alltoall import attend_head_shard
from tetris.actors.prefill.group_exchange import GroupExchange
from tetris.actors.prefill.head_shards import head_shard_slices
from tetris.actors.prefill.world import PeerLink

from tetris.model.layers import RotaryEmbedding

__all__ = ["SpTpAttention", "shard_qkv"]


def shard_qkv(model, i: int, hidden: torch.Tensor, positions: torch.Tensor, qh: slice,
              kh: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q [T, |qh|, D], K, V [T, |kh|, D] of layer ``i`` for one head shard: the rows of the
    fused ``W_QKV`` a TP rank of those heads holds (``LlamaModel._qkv`` restricted to them)."""
    layer = model.layers[i]
    hq, hkv, d = model.local_num_heads, model.local_num_kv_heads, model.head_dim
    w = layer.self_attn.qkv.weight
    rows = torch.cat((torch.arange(qh.start * d, qh.stop * d),
                      torch.arange((hq + kh.start) * d, (hq + kh.stop) * d),
                      torch.arange((hq + hkv + kh.start) * d, (hq + hkv + kh.stop) * d)))
    t, nq, nk = hidden.shape[0], qh.stop - qh.start, kh.stop - kh.start
    qkv = F.linear(layer.input_layernorm(hidden), w[rows.to(w.device)])
    cos, sin = model.rotary.cos_sin(positions, hidden.dtype)
    qk = RotaryEmbedding.rotate(qkv[:, :(nq + nk) * d].view(t, nq + nk, d), cos, sin)
    return qk[:, :nq], qk[:, nq:], qkv[:, (nq + nk) * d:].view(t, nk, d)


def _instance_sum(model, part: torch.Tensor) -> torch.Tensor:
    """Sum a member's reduced rows [n_r, d] over its instance's TP ranks (head slices): the
    all-reduce of the instance's row-parallel ``o_proj`` (module docstring). Every TP rank of
    an instance holds the same rows, so an idle member's ranks skip it together."""
    if model.tp_size > 1 and part.numel():
        part = part.contiguous()
        dist.all_reduce(part, group=model.tp_group)
    return part


class SpTpAttention(GroupExchange):
    """One member's SP-TP for one chunk: per layer an all-gather and a reduce-scatter on
    ``link``. query_positions[j], block_positions[j]: int64 sorted positions of member j's
    chunk rows and KV block; ``chunk_start``: block positions below it are history."""

    def __init__(self, group: tuple[int, ...], rank: int, query_positions: list[torch.Tensor],
                 block_positions: list[torch.Tensor], chunk_start: int, tag: int,
                 timeout_s: float, link: PeerLink | None = None) -> None:
        super().__init__(group, rank, tag, timeout_s, link)
        self.query_positions = query_positions
        self.history_positions = [b[b < chunk_start] for b in block_positions]
        pos = torch.cat(query_positions)
        self.order = torch.argsort(pos)          # gathered rows -> position order
        self.chunk_pos = pos[self.order]
        # where member j's rows sit in position order (their partials go back to j)
        self.rows_of = [torch.searchsorted(self.chunk_pos, p) for p in query_positions]

    def attention_block(self, model, i: int, hidden, k_block, v_block):
        """hidden [n_r, d] (layer input), k_block, v_block [m_r, Hkv, D] (this member's block,
        history rows first) -> hidden + attention output [n_r, d], as ``layer_attn_out``."""
        s, d = self.sp_size, model.head_dim
        shards = [head_shard_slices(j, s, model.local_num_heads, model.local_num_kv_heads)
                  for j in range(s)]
        n_hist = self.history_positions[self.rank].numel()
        hist_out = [torch.stack((k_block[:n_hist, kh], v_block[:n_hist, kh]), dim=1)
                    for _, kh in shards]
        qh, kh = shards[self.rank]
        rows, hist_kv = self.all_gather(hidden, hist_out, kh.stop - kh.start, d, i)
        q, k, v = shard_qkv(model, i, rows[self.order], self.chunk_pos, qh, kh)
        out = attend_head_shard([q], [self.chunk_pos],
                                hist_kv + [torch.stack((k, v), dim=1)],
                                self.history_positions + [self.chunk_pos])[0]
        w_o = model.layers[i].self_attn.o_proj.weight
        partial = F.linear(out.reshape(out.shape[0], -1).to(hidden.dtype),
                           w_o[:, qh.start * d: qh.stop * d])
        return hidden + _instance_sum(model, self.reduce_scatter(partial, hidden.shape[0], i))

    def all_gather(self, hidden, hist_out, my_kh: int, d: int, layer: int):
        """Every member's rows in member order [l, width], and per member the history KV
        ``[m_j, 2, my_kh, D]`` of my heads; hist_out[j]: my history KV for member j's heads."""
        s, width = self.sp_size, hidden.shape[1]
        outgoing = [torch.cat((hidden.reshape(-1), kv.reshape(-1))) for kv in hist_out]
        sizes = [(self.query_positions[j].numel() * width,
                  self.history_positions[j].numel() * 2 * my_kh * d) for j in range(s)]
        incoming = self._exchange(outgoing, [a + b for a, b in sizes], hidden.dtype, layer, 1)
        rows = torch.cat([m[:a].view(-1, width) for m, (a, _) in zip(incoming, sizes)])
        return rows, [m[a:].view(-1, 2, my_kh, d) for m, (a, _) in zip(incoming, sizes)]

    def reduce_scatter(self, partial, n_mine: int, layer: int):
        """Σ over members of their partial rows of my queries [n_mine, width]; partial: this
        member's ``[l, width]`` in position order."""
        width = partial.shape[1]
        back = self._exchange([partial[r].reshape(-1).contiguous() for r in self.rows_of],
                              [n_mine * width] * self.sp_size, partial.dtype, layer, 2)
        total = back[0].view(-1, width).clone()
        for b in back[1:]:          # member order on every member: deterministic sums
            total += b.view(-1, width)
        return total

    def _step_name(self, layer: int, which: int) -> str:
        return f"SP-TP {('all-gather', 'reduce-scatter')[which - 1]} of layer {layer}"
