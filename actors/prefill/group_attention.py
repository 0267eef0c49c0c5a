"""The attention of one chunk across its group, by the plan's layout (the executor calls it
once per chunk): the zigzag ring (whole blocks or in micro-partitions), CSA's lossy ring,
SP-NTP all-to-all (whole or pipelined) or SP-TP (flat or hierarchical across nodes)."""

from __future__ import annotations

from tetris.actors.prefill.alltoall import AllToAllAttention
from tetris.actors.prefill.alltoall_pipeline import PipelinedAllToAll
from tetris.actors.prefill.csa_ring import CsaRingAttention
from tetris.actors.prefill.kv_store import ranges_tensor
from tetris.actors.prefill.messages import ChunkTask
from tetris.actors.prefill.ring import RING_TAG_KIND, RingAttention
from tetris.actors.prefill.ring_pipeline import PipelinedRing
from tetris.actors.prefill.sptp import SpTpAttention
from tetris.actors.prefill.sptp_hier import hierarchical_sptp
from tetris.actors.prefill.world import PeerLink

__all__ = ["group_attention", "message_tag"]

_TAG_SPACE = 1 << 30


def message_tag(seq: int, kind: int) -> int:
    """Gloo tag of one chunk's traffic of one kind (ring or balancing)."""
    return (seq * 2 + kind) % _TAG_SPACE


def group_attention(task: ChunkTask, blocks, link: PeerLink | None, num_layers: int = 0):
    """The chunk's attention across its group, by the plan's layout: the zigzag ring, or SP-NTP
    all-to-all (one chunk's traffic is one kind or the other, so both use the ring's tag)."""
    tag = message_tag(task.seq, RING_TAG_KIND)
    block_pos = [ranges_tensor(b) for b in blocks]
    if task.sp_layout == "a2a" and task.sp_micro_partitions > 1:
        return PipelinedAllToAll(task.group, task.rank,
                                 [ranges_tensor(c) for c in task.chunk_positions], block_pos,
                                 tag, task.timeout_s, link,
                                 micro_partitions=task.sp_micro_partitions)
    if task.sp_layout == "sptp":
        args = (task.group, task.rank, [ranges_tensor(c) for c in task.chunk_positions],
                block_pos, task.chunk_start, tag, task.timeout_s, link)
        if len(set(task.sp_member_nodes)) > 1:   # intra-node first (sptp_hier.py)
            return hierarchical_sptp(*args, member_nodes=task.sp_member_nodes)
        return SpTpAttention(*args)
    if task.csa_drop_ratios:   # LOSSY, opt-in; ring chunks only (chunks.chunk_task)
        return CsaRingAttention(task.group, task.rank, block_pos, tag, task.timeout_s, link,
                                member_nodes=task.sp_member_nodes or (0,) * len(task.group),
                                drop_ratios=task.csa_drop_ratios, num_layers=num_layers,
                                drop_queries=task.csa_drop_queries)
    if task.sp_layout == "a2a":
        return AllToAllAttention(task.group, task.rank,
                                 [ranges_tensor(c) for c in task.chunk_positions], block_pos,
                                 tag, task.timeout_s, link)
    if task.sp_micro_partitions > 1:   # the ring's blocks in pieces (ring_pipeline.py)
        return PipelinedRing(task.group, task.rank, block_pos, tag, task.timeout_s, link,
                             micro_partitions=task.sp_micro_partitions)
    return RingAttention(task.group, task.rank, block_pos, tag, task.timeout_s, link)
