"""The ring over micro-partitions: each ring step's KV block travels in ``M`` pieces, and the
attention on piece ``m`` runs while piece ``m+1`` is still in flight (issue #26, item 4).

``RingAttention`` (ring.py) forwards a whole block per step: member ``r`` attends to the block
it holds while sending it to ``r + 1`` and receiving the next from ``r − 1``, so it cannot start
on a block before all of it has arrived, nor forward it before then. Here block ``j`` (its
``n_j`` rows sorted by position) is cut into ``M`` row ranges ``[m·n_j/M, (m+1)·n_j/M)``; the
unit of the ring is the piece ``(t, m)``: piece ``m`` of the block member ``r`` holds at step
``t``. Per layer every member runs one schedule:

    t = 0:  post (0, m) for every m: send piece m of the own block to r+1, receive piece m of
            the next block from r−1; attend q to the own block whole
    for t in 1..s−1, for m in 0..M−1:
        wait the exchange posted at (t−1, m)      (piece (t, m) is here)
        post (t, m): send piece (t, m) on to r+1, receive piece (t+1, m) from r−1   (t < s−1)
        attend q to piece (t, m), merge by log-sum-exp (ring.partial_attention)

so a piece is forwarded as soon as it arrives and attention on piece ``m`` overlaps the
arrival of pieces ``m+1, …``. On a transfer-bound ring the last step's attention, which the
whole-block ring runs after its last block has arrived, now hides all but ``1/M`` of itself.
The partial outputs of all ``s·M`` pieces merge by LSE (the online softmax of CSPS §3.2.5), so
the result equals the whole-block ring's up to float rounding.

Messages between two members share the chunk's tag and are posted in the same (t, m) order on
both sides (gloo matches them in order); a piece with no rows is neither sent nor received,
and both sides know the sizes from the plan. Waiting on (t−1, m) before (t, m) cannot deadlock:
it needs only neighbours' exchanges from earlier (t, m) in the same order.

This is not CSPS's three-phase pipeline (communicate, compute, communicate around SP-NTP's two
all-to-alls: alltoall_pipeline.py); it is the same idea, online-softmax merging over
micro-partitions, applied to the ring's block steps. Selected per chunk by ``sp_layout =
"ring"`` with ``sp_micro_partitions > 1`` (``--plan 900x2:ring/4``).
"""

from __future__ import annotations

import torch
from tetris.actors.prefill.ring import RingAttention, partial_attention, ring_source

__all__ = ["PipelinedRing", "micro_cuts"]


def micro_cuts(rows: int, micro_partitions: int) -> list[int]:
    """Row bounds ``c_0 = 0 <= ... <= c_M = rows`` of a block's ``M`` micro-partitions."""
    return [(m * rows) // micro_partitions for m in range(micro_partitions + 1)]


class PipelinedRing(RingAttention):
    """The ring with each step's block sent in ``micro_partitions`` pieces (module docstring)."""

    def __init__(self, *args, micro_partitions: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if micro_partitions < 1:
            raise ValueError(f"micro_partitions must be at least 1, got {micro_partitions}")
        self.micro_partitions = micro_partitions
        self.cuts = [micro_cuts(p.numel(), micro_partitions) for p in self.block_positions]

    def __call__(self, q, q_pos, k_block, v_block, layer: int = 0, scale=None):
        """q [Tq, Hq, D] at q_pos; k_block, v_block [n_r, Hkv, D]: this member's block.

        Returns out [Tq, Hq, D]: attention over every member's block."""
        s, r, M = self.sp_size, self.rank, self.micro_partitions
        kv = torch.stack([k_block, v_block], dim=1).contiguous()     # [n_r, 2, Hkv, D]
        # Step 0: every piece of the own block leaves at once, and the block is attended whole
        # (nothing to wait for; whole, its diagonal keeps the causal kernel, not a position mask)
        c = self.cuts[r]
        # held[m] at step t >= 1: (works, piece m) of the exchange posted at (t−1, m)
        held = [self._post_piece(kv[c[m]:c[m + 1]], 0, m) for m in range(M)] if s > 1 else []
        acc = partial_attention(q, q_pos, k_block, v_block, self.block_positions[r], None, scale)
        for t in range(1, s):
            src = ring_source(r, t, s)
            nxt: list = [None] * M
            for m in range(M):
                works, piece = held[m]
                self._await(works, self._piece_name(layer, t, m))
                if t < s - 1:
                    nxt[m] = self._post_piece(piece, t, m)
                lo, hi = self.cuts[src][m], self.cuts[src][m + 1]
                acc = partial_attention(q, q_pos, piece[:, 0], piece[:, 1],
                                        self.block_positions[src][lo:hi], acc, scale)
            held = nxt
        return acc[0]

    def _post_piece(self, piece: torch.Tensor, step: int, m: int):
        """Send piece m of the held block to r+1, receive piece m of the next from r−1."""
        s, r = self.sp_size, self.rank
        c = self.cuts[ring_source(r, step + 1, s)]
        nxt = piece.new_empty((c[m + 1] - c[m], *piece.shape[1:]))
        sends = [(piece, self.group[(r + 1) % s])] if piece.shape[0] else []
        self.sent_elements += sum(x.numel() for x, _ in sends)
        recvs = [(nxt, self.group[(r - 1) % s])] if nxt.shape[0] else []
        return self.link.exchange(sends, recvs, self.tag), nxt

    def _piece_name(self, layer: int, step: int, m: int) -> str:
        return f"ring step {step - 1} (micro-partition {m}) of layer {layer}"
