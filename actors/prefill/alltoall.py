"""SP-NTP for a chunk group: all-to-all from sequence shards to head shards and back (CSPS §3.2.1,
Fig. 4a; DeepSpeed-Ulysses).

Per layer, member ``r`` of a group of ``s`` holds queries for its zigzag share of the chunk
(all heads) and its KV *block* (its history share plus its chunk share, all KV heads), exactly
what the ring starts from. Head shard ``j`` is query heads ``[j·Hq/s, (j+1)·Hq/s)`` with the KV
heads they read, ``[j·Hkv/s, (j+1)·Hkv/s)`` (GQA: query head ``h`` reads KV head
``h // (Hq/Hkv)``), so ``s`` must divide ``Hkv``, or be a multiple of it: then each KV head is
replicated on ``s/Hkv`` members, and sent to each of them (head_shards.py); any other group
runs the ring instead (``resolve_sp_layout``).

1. A2A #1: member ``r`` sends member ``j`` the rows of head shard ``j``: its queries and its
   whole block's K, V. History KV travels with the chunk's, so head shard ``j`` ends up with
   every key of ``[0, end)``: the history attention is the same one full-sequence attention,
   not a separate step (the history is sequence-sharded over the earlier chunks' members, and
   a head-sharded member has to see all of it for its heads).
2. Member ``j`` sorts the queries and keys by position and attends ``[start, end)`` to
   ``[0, end)`` for its heads (history keys unmasked, chunk keys causal).
3. A2A #2: member ``j`` sends each member the outputs of that member's queries for head shard
   ``j``; each member joins the head shards back into ``[n_r, Hq, D]``.

The stored KV never moves: each member keeps the KV of its own share, as under the ring, so the
hand-off to decode and cache balancing see the same layout whatever the chunk's layout was.
All-to-all is point-to-point sends on the pool's world (``PeerLink``), like the ring; one
message per peer and direction, sized from the plan (no handshake).

``simulate_all_to_all`` runs the same steps in one process: the reference the distributed
version is tested against.
"""

from __future__ import annotations

import torch
from tetris.actors.prefill.group_exchange import GroupExchange
from tetris.actors.prefill.head_shards import head_shard_slices, head_split_problem
from tetris.actors.prefill.ring import partial_attention
from tetris.actors.prefill.world import PeerLink

__all__ = [
    "AllToAllAttention",
    "attend_head_shard",
    "head_shard",
    "resolve_sp_layout",
    "simulate_all_to_all",
]


def resolve_sp_layout(requested: str, sp_size: int, num_kv_heads: int,
                      num_heads: int | None = None) -> tuple[str, str]:
    """The layout a chunk of ``sp_size`` members runs, and why: "a2a" and "sptp" need head
    shards (head_shards.py: the group divides the KV heads, or is a multiple of them and
    replicates them); without ``num_heads`` only the KV-head condition is checked here, the
    worker checks the rest."""
    if requested == "sptp":
        why = head_split_problem(sp_size, num_heads or num_kv_heads * sp_size, num_kv_heads)
        return ("sptp", "") if not why else ("ring", f"sptp asked, ring run: {why}")
    if requested != "a2a":
        return requested, ""
    why = head_split_problem(sp_size, num_heads or num_kv_heads * sp_size, num_kv_heads)
    return ("a2a", "") if not why else ("ring", f"a2a asked, ring run: {why}")


def head_shard(j: int, sp_size: int, num_heads: int, num_kv_heads: int) -> tuple[slice, slice]:
    """Query-head and KV-head slices of head shard ``j``: whole KV heads when ``sp_size``
    divides them, one KV head replicated on ``sp_size / Hkv`` members when ``Hkv`` divides
    ``sp_size`` (head_shards.py)."""
    return head_shard_slices(j, sp_size, num_heads, num_kv_heads)


def attend_head_shard(qs, q_pos, kvs, k_pos, scale=None) -> list[torch.Tensor]:
    """One head shard's attention over the whole chunk and its history.

    qs[j]: [n_j, hq, D] member j's queries (this shard's heads) at sorted q_pos[j];
    kvs[j]: [m_j, 2, hkv, D] member j's block at sorted k_pos[j].
    Returns per member j its queries' outputs [n_j, hq, D].
    """
    qp = torch.cat(q_pos)
    q_order = torch.argsort(qp)
    kp = torch.cat(k_pos)
    k_order = torch.argsort(kp)
    kv = torch.cat(kvs)[k_order]
    if qp.numel() == 0:
        return [q for q in qs]
    out, _ = partial_attention(torch.cat(qs)[q_order], qp[q_order], kv[:, 0], kv[:, 1],
                               kp[k_order], scale=scale)
    unsorted = torch.empty_like(out)
    unsorted[q_order] = out
    return list(torch.split(unsorted, [q.shape[0] for q in qs]))


def simulate_all_to_all(qs, q_pos, ks, vs, k_pos, scale=None) -> list[torch.Tensor]:
    """Single-process SP-NTP: each member's attention output, shard by shard.

    qs[r]: [n_r, Hq, D]; ks[r], vs[r]: [m_r, Hkv, D] (member r's block); *_pos: sorted int64.
    """
    s = len(qs)
    hq, hkv = qs[0].shape[1], ks[0].shape[1]
    per_shard = []
    for j in range(s):
        qh, kh = head_shard(j, s, hq, hkv)
        per_shard.append(attend_head_shard(
            [q[:, qh] for q in qs], q_pos,
            [torch.stack((k[:, kh], v[:, kh]), dim=1) for k, v in zip(ks, vs)], k_pos, scale))
    return [torch.cat([per_shard[j][r] for j in range(s)], dim=1) for r in range(s)]


class AllToAllAttention(GroupExchange):
    """One member's SP-NTP for one chunk: every layer's two all-to-alls on ``link``.

    group: world ranks in group order; query_positions[j], block_positions[j]: int64 positions
    of member j's queries and KV block. Same call as ``RingAttention``.
    """

    def __init__(self, group: tuple[int, ...], rank: int, query_positions: list[torch.Tensor],
                 block_positions: list[torch.Tensor], tag: int, timeout_s: float,
                 link: PeerLink | None = None) -> None:
        # sent_elements: per chunk, both all-to-alls: the Appendix A volume, measured
        super().__init__(group, rank, tag, timeout_s, link)
        self.query_positions = query_positions
        self.block_positions = block_positions

    def __call__(self, q, q_pos, k_block, v_block, layer: int = 0, scale=None):
        """q [n_r, Hq, D] at q_pos; k_block, v_block [m_r, Hkv, D]: this member's block.

        Returns out [n_r, Hq, D]: attention over the chunk and its whole history.
        """
        s = self.sp_size
        hq, hkv, d = q.shape[1], k_block.shape[1], q.shape[2]
        qh_n, kh_n = hq // s, max(hkv // s, 1)   # a KV head per member when replicated
        # A2A #1: one flat message per peer, [its heads' queries ; its heads' K, V of my block].
        outgoing = []
        for j in range(s):
            qh, kh = head_shard(j, s, hq, hkv)
            kv = torch.stack((k_block[:, kh], v_block[:, kh]), dim=1)
            outgoing.append(torch.cat((q[:, qh].reshape(-1), kv.reshape(-1))))
        sizes = [(self.query_positions[j].numel() * qh_n * d,
                  self.block_positions[j].numel() * 2 * kh_n * d) for j in range(s)]
        incoming = self._exchange(outgoing, [a + b for a, b in sizes], q.dtype, layer, 1)
        qs = [m[:a].view(-1, qh_n, d) for m, (a, _) in zip(incoming, sizes)]
        kvs = [m[a:].view(-1, 2, kh_n, d) for m, (a, _) in zip(incoming, sizes)]
        outs = attend_head_shard(qs, self.query_positions, kvs, self.block_positions, scale)
        # A2A #2: member j gets its queries' outputs for my head shard.
        back = self._exchange([o.reshape(-1).contiguous() for o in outs],
                              [q.shape[0] * qh_n * d] * s, q.dtype, layer, 2)
        return torch.cat([b.view(-1, qh_n, d) for b in back], dim=1)

    def _step_name(self, layer: int, which: int) -> str:
        return f"all-to-all #{which} of layer {layer}"
