"""Ring attention over any subset of the pool's world ranks (SPEC §6, paper §4.1).

Each member ``r`` of a ring of ``s`` holds a KV *block*: its share of the request's history
plus its zigzag share of the current chunk, with absolute positions. At step ``t`` member ``r``
attends with its queries to the block that started on member ``(r - t) mod s``, while it sends
the block it holds to ``r + 1`` and receives the next one from ``r - 1``; partial results merge
by log-sum-exp. The absolute-position mask (key ``j`` visible to query ``i`` iff
``k_pos[j] <= q_pos[i]``) makes history keys fully visible and chunk keys causal, so one call
per step serves both.

Block sizes differ by member and are known to every member from the plan, so receivers size
their buffers without a handshake, and empty blocks are simply not sent. The rings use P2P
operations on the one world group made at pool start: no group is created per chunk, and
ranks outside the ring take no part.

``simulate_ring`` runs the same steps in one process (no communication): the reference the
distributed version is tested against.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["partial_attention", "ring_source", "simulate_ring", "RingAttention", "RING_TAG_KIND"]

RING_TAG_KIND = 0

try:  # the capability-based chooser, once the kernels helper lands it
    from tetris.kernels.dispatch import attention_with_lse, merge_attention
except ImportError:  # pragma: no cover - fallback to the torch path of the same contract
    from tetris.kernels.attention import attention_with_lse
    from tetris.kernels.merge import merge_attention


def ring_source(rank: int, step: int, sp_size: int) -> int:
    """Ring member whose block member ``rank`` holds at ``step``."""
    return (rank - step) % sp_size


def partial_attention(q, q_pos, k, v, k_pos, acc=None, scale=None):
    """Attend q [Tq, Hq, D] to one block k, v [Tk, Hkv, D] and merge into ``acc``.

    acc: None or (out [Tq, Hq, D], lse [Hq, Tq] fp32). Empty queries or keys leave acc as is.
    """
    if q.shape[0] == 0 or k.shape[0] == 0:
        if acc is not None:
            return acc
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
        return torch.zeros_like(q), lse
    out, lse = attention_with_lse(q, k, v, q_positions=q_pos, k_positions=k_pos, scale=scale)
    if acc is None:
        return out, lse
    return merge_attention(acc[0], acc[1], out, lse)


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


class RingAttention:
    """One member's ring for one chunk: runs every layer's ring on the world group.

    group: world ranks in ring order; block_positions[j]: int64 positions of member j's block.
    ``tag`` keeps this chunk's messages apart from other traffic between the same ranks.
    """

    def __init__(self, group: tuple[int, ...], rank: int, block_positions: list[torch.Tensor],
                 tag: int, timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.block_positions = block_positions
        self.tag = tag
        self.timeout = timedelta(seconds=timeout_s)
        self.comm_wait_s = 0.0

    @property
    def sp_size(self) -> int:
        return len(self.group)

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
        ops = []
        if cur.shape[0]:
            ops.append(dist.P2POp(dist.isend, cur, self.group[(r + 1) % s], tag=self.tag))
        if n_in:
            ops.append(dist.P2POp(dist.irecv, nxt, self.group[(r - 1) % s], tag=self.tag))
        return (dist.batch_isend_irecv(ops) if ops else []), nxt

    def _wait(self, works, layer: int, step: int) -> None:
        t0 = time.perf_counter()
        for w in works:
            if not w.wait(self.timeout):
                raise TimeoutError(f"ring step {step} of layer {layer} timed out")
        self.comm_wait_s += time.perf_counter() - t0
