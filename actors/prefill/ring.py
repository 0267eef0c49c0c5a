"""Ring attention over any subset of the pool's world ranks (SPEC §6, paper §4.1).

Each member ``r`` of a ring of ``s`` holds a KV *block*: its share of the request's history
plus its zigzag share of the current chunk, with absolute positions. At step ``t`` member ``r``
attends with its queries to the block that started on member ``(r - t) mod s``, while it sends
the block it holds to ``r + 1`` and receives the next one from ``r - 1``; partial results merge
by log-sum-exp. Visibility is by absolute position (key ``j`` visible to query ``i`` iff
``k_pos[j] <= q_pos[i]``): history keys are fully visible, chunk keys causal.

Block sizes differ by member and are known to every member from the plan, so receivers size
their buffers without a handshake, and empty blocks are simply not sent. The rings use P2P
operations on the pool's world (``actors/prefill/world.py``: the generation the chunk names): no group
is created per chunk, and ranks outside the ring take no part.

``simulate_ring`` runs the same steps in one process (no communication): the reference the
distributed version is tested against.
"""

from __future__ import annotations

import torch

__all__ = ["partial_attention", "ring_source", "simulate_ring", "RingAttention", "RING_TAG_KIND"]

RING_TAG_KIND = 0

from tetris.actors.prefill.group_exchange import GroupExchange
from tetris.actors.prefill.world import PeerLink
from tetris.kernels.dispatch import attention_with_lse, merge_attention


def ring_source(rank: int, step: int, sp_size: int) -> int:
    """Ring member whose block member ``rank`` holds at ``step``."""
    return (rank - step) % sp_size


def partial_attention(q, q_pos, k, v, k_pos, acc=None, scale=None):
    """Attend q [Tq, Hq, D] to one block k, v [Tk, Hkv, D] and merge into ``acc``.

    q_pos, k_pos: sorted int64 positions. acc: None or (out [Tq, Hq, D], lse [Hq, Tq] fp32).
    Each contiguous run of queries ``[lo, hi)`` (a zigzag piece) meets the block's keys in two
    slices: keys before ``lo`` are all visible (no mask: the fast unmasked kernel), keys inside
    ``[lo, hi)`` need the causal or position mask, and later keys are skipped. So the position
    mask is only ever built for the diagonal, and history keys never need one.
    """
    tq = q.shape[0]
    if tq == 0 or k.shape[0] == 0:
        if acc is not None:
            return acc
        lse = torch.full((q.shape[1], tq), float("-inf"), dtype=torch.float32, device=q.device)
        return torch.zeros_like(q), lse
    outs, lses = [], []
    for a, b in _runs(q_pos):
        lo, hi = int(q_pos[a]), int(q_pos[b - 1]) + 1
        i_lo, i_hi = torch.searchsorted(k_pos, torch.tensor([lo, hi])).tolist()
        part = None
        if i_lo:
            part = attention_with_lse(q[a:b], k[:i_lo], v[:i_lo], scale=scale)
        if i_hi > i_lo:
            kp = k_pos[i_lo:i_hi]
            if i_hi - i_lo == b - a and torch.equal(kp, q_pos[a:b]):
                diag = attention_with_lse(q[a:b], k[i_lo:i_hi], v[i_lo:i_hi], causal=True,
                                          scale=scale)
            else:
                diag = attention_with_lse(q[a:b], k[i_lo:i_hi], v[i_lo:i_hi],
                                          q_positions=q_pos[a:b], k_positions=kp, scale=scale)
            part = diag if part is None else merge_attention(*part, *diag)
        if part is None:
            part = (torch.zeros_like(q[a:b]),
                    torch.full((q.shape[1], b - a), float("-inf"), dtype=torch.float32,
                               device=q.device))
        outs.append(part[0])
        lses.append(part[1])
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses, 1))
    return (out, lse) if acc is None else merge_attention(acc[0], acc[1], out, lse)


def _runs(pos: torch.Tensor) -> list[tuple[int, int]]:
    """Index ranges of the contiguous runs of sorted positions [n]."""
    breaks = ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().add(1).tolist()
    idx = [0, *breaks, pos.numel()]
    return list(zip(idx[:-1], idx[1:]))


def simulate_ring(qs, q_pos, ks, vs, k_pos, scale=None) -> list[torch.Tensor]:
    """Single-process ring: each member's attention output, step by step as the ring runs.

    qs[r]: [Tq_r, Hq, D]; ks[r], vs[r]: [Tk_r, Hkv, D] (member r's block); *_pos: int64.
    """
    s = len(qs)
    outs = []
    for r in range(s):
        acc = None
        for t in range(s):
            src = ring_source(r, t, s)
            acc = partial_attention(qs[r], q_pos[r], ks[src], vs[src], k_pos[src], acc, scale)
        outs.append(acc[0])
    return outs


class RingAttention(GroupExchange):
    """One member's ring for one chunk: runs every layer's ring on ``link`` (the chunk's
    world; default: the process's default group).

    group: world ranks in ring order; block_positions[j]: int64 positions of member j's block.
    ``tag`` keeps this chunk's messages apart from other traffic between the same ranks.
    """

    def __init__(self, group: tuple[int, ...], rank: int, block_positions: list[torch.Tensor],
                 tag: int, timeout_s: float, link: PeerLink | None = None) -> None:
        super().__init__(group, rank, tag, timeout_s, link)
        self.block_positions = block_positions

    def __call__(self, q, q_pos, k_block, v_block, layer: int = 0, scale=None):
        """q [Tq, Hq, D] at q_pos; k_block, v_block [n_r, Hkv, D]: this member's block.

        Returns out [Tq, Hq, D]: attention over every member's block.
        """
        s, r = self.sp_size, self.rank
        cur = torch.stack([k_block, v_block], dim=1).contiguous()    # [n, 2, Hkv, D]
        acc = None
        for t in range(s):
            src = ring_source(r, t, s)
            works, nxt = self._post_step(cur, t) if t < s - 1 else ([], None)
            acc = partial_attention(q, q_pos, cur[:, 0], cur[:, 1], self.block_positions[src],
                                    acc, scale)
            self._wait(works, layer, t)
            cur = nxt
        return acc[0]

    def _post_step(self, cur: torch.Tensor, step: int):
        """Send the held block to r+1 and receive block (r-step-1) from r-1."""
        s, r = self.sp_size, self.rank
        incoming = ring_source(r, step + 1, s)
        n_in = self.block_positions[incoming].numel()
        nxt = cur.new_empty((n_in, *cur.shape[1:]))
        sends = [(cur, self.group[(r + 1) % s])] if cur.shape[0] else []
        self.sent_elements += sum(t.numel() for t, _ in sends)
        recvs = [(nxt, self.group[(r - 1) % s])] if n_in else []
        return self.link.exchange(sends, recvs, self.tag), nxt

    def _step_name(self, layer: int, step: int) -> str:
        return f"ring step {step} of layer {layer}"
