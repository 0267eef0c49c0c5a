"""Three-phase pipelining of SP-NTP over micro-partitions (CSPS §3.2.5): while the all-to-all of
micro-partition m+1 is in flight, head shard attention runs on micro-partition m, and the
outputs of m go back while m+1 computes.

The chunk ``[start, end)`` is cut into ``M`` position ranges. Micro-partition ``m`` of a member
is its queries in range ``m`` and its block's rows up to the range's end not sent before (the
history rides with micro-partition 0). A head shard attends micro-partition m's queries to every
key received so far, which is exactly the keys a query of range m can see (history, earlier
ranges, its own range causally), so no merging across micro-partitions is needed and the
result equals the unpipelined all-to-all (``alltoall.py``) up to float rounding.

Every member runs the same schedule per layer, so the messages between two members, all on
one tag, are posted in the same order on both sides (gloo matches them in order):

    post A2A#1(0); for m: post A2A#1(m+1); wait A2A#1(m); attend m; post A2A#2(m)
    wait every A2A#2; join the head shards.
"""

from __future__ import annotations

import torch
from tetris.actors.prefill.alltoall import AllToAllAttention, head_shard
from tetris.actors.prefill.ring import partial_attention

__all__ = ["PipelinedAllToAll", "micro_bounds"]


def micro_bounds(query_positions: list[torch.Tensor], micro_partitions: int) -> list[int]:
    """Position bounds ``b_0 < ... <= b_M`` of the chunk's micro-partitions (equal lengths)."""
    present = [p for p in query_positions if p.numel()]
    start = min(int(p[0]) for p in present)
    end = max(int(p[-1]) for p in present) + 1
    n = end - start
    return [start + (m * n) // micro_partitions for m in range(micro_partitions + 1)]


class PipelinedAllToAll(AllToAllAttention):
    """SP-NTP with ``micro_partitions`` micro-partitions per layer (module docstring)."""

    def __init__(self, *args, micro_partitions: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if micro_partitions < 1:
            raise ValueError(f"micro_partitions must be at least 1, got {micro_partitions}")
        b = micro_bounds(self.query_positions, micro_partitions)
        self.micro_partitions = micro_partitions
        # per member j, per micro-partition m: query rows and block rows [lo, hi)
        self.q_rows = [_rows(p, b, history=False) for p in self.query_positions]
        self.k_rows = [_rows(p, b, history=True) for p in self.block_positions]

    def __call__(self, q, q_pos, k_block, v_block, layer: int = 0, scale=None):
        s, r, M = self.sp_size, self.rank, self.micro_partitions
        hq, hkv, d = q.shape[1], k_block.shape[1], q.shape[2]
        qn, kn = hq // s, max(hkv // s, 1)   # a KV head per member when replicated
        kv = torch.stack([k_block, v_block], dim=1)                 # [m_r, 2, Hkv, D]
        shards = [head_shard(j, s, hq, hkv) for j in range(s)]
        out = q.new_empty(q.shape)
        keys = kv.new_empty((0, 2, kn, d))
        key_pos = self.block_positions[r].new_empty(0)
        pending = {0: self._post_qkv(0, q, kv, shards, qn, kn, d)}
        back = []
        for m in range(M):
            if m + 1 < M:
                pending[m + 1] = self._post_qkv(m + 1, q, kv, shards, qn, kn, d)
            incoming, works = pending.pop(m)
            self._wait(works, layer, 1)
            qs = [x[:self._n_q(j, m) * qn * d].view(-1, qn, d) for j, x in enumerate(incoming)]
            piece = [x[self._n_q(j, m) * qn * d:].view(-1, 2, kn, d) for j, x in enumerate(incoming)]
            piece_pos = [self.block_positions[j][slice(*self.k_rows[j][m])] for j in range(s)]
            # Keys of range m come after every earlier key: the sorted keys grow at the end.
            order = torch.argsort(torch.cat(piece_pos))
            keys = torch.cat((keys, torch.cat(piece)[order]))
            key_pos = torch.cat((key_pos, torch.cat(piece_pos)[order]))
            outs = self._attend(qs, m, keys, key_pos, scale)
            back.append(self._post_out(m, outs, q.dtype, qn, d))
        for m, (incoming, works) in enumerate(back):
            self._wait(works, layer, 2)
            lo, hi = self.q_rows[r][m]
            for j, (qh, _) in enumerate(shards):
                out[lo:hi, qh] = incoming[j].view(hi - lo, qn, d)
        return out

    def _n_q(self, j: int, m: int) -> int:
        lo, hi = self.q_rows[j][m]
        return hi - lo

    def _post_qkv(self, m, q, kv, shards, qn, kn, d):
        """A2A #1 of micro-partition m: my queries in range m and my block rows for it."""
        r = self.rank
        ql, qh_ = self.q_rows[r][m]
        kl, kh_ = self.k_rows[r][m]
        outgoing = [torch.cat((q[ql:qh_, qs].reshape(-1), kv[kl:kh_, :, ks].reshape(-1)))
                    for qs, ks in shards]
        sizes = [self._n_q(j, m) * qn * d + (self.k_rows[j][m][1] - self.k_rows[j][m][0]) * 2 * kn * d
                 for j in range(self.sp_size)]
        return self._post(outgoing, sizes, q.dtype)

    def _attend(self, qs, m, keys, key_pos, scale) -> list[torch.Tensor]:
        """This head shard's outputs for every member's queries of range m."""
        q_pos = [self.query_positions[j][slice(*self.q_rows[j][m])] for j in range(self.sp_size)]
        qp = torch.cat(q_pos)
        if qp.numel() == 0:
            return list(qs)
        order = torch.argsort(qp)
        o, _ = partial_attention(torch.cat(qs)[order], qp[order], keys[:, 0], keys[:, 1], key_pos,
                                 scale=scale)
        unsorted = torch.empty_like(o)
        unsorted[order] = o
        return list(torch.split(unsorted, [x.shape[0] for x in qs]))

    def _post_out(self, m, outs, dtype, qn, d):
        """A2A #2 of micro-partition m: member j's outputs for my head shard."""
        sizes = [self._n_q(self.rank, m) * qn * d] * self.sp_size
        return self._post([o.reshape(-1).contiguous() for o in outs], sizes, dtype)


def _rows(positions: torch.Tensor, bounds: list[int], *, history: bool) -> list[tuple[int, int]]:
    """Row ranges of sorted ``positions`` per micro-partition; with ``history`` the rows before
    the chunk belong to micro-partition 0."""
    cut = torch.searchsorted(positions, torch.tensor(bounds)).tolist()
    if history:
        cut[0] = 0
    return [(cut[m], cut[m + 1]) for m in range(len(bounds) - 1)]
