"""The KV of a cached prefix, streamed to decode: what the simulator charges for it.

A run planned from a cached prefix (``PrefillPlan.cached_tokens`` > 0) computes only its
suffix; the prefix's KV lies on the holders (``cached_instances``). The live pool copies it
there when chunk 0's turn has come and every holder streams its copy to the decode instance
as the pseudo-chunk ``PREFIX_CHUNK`` = -1 (``actors/prefill/prefix.py``), every layer ready at
once. Here that pseudo-chunk is a ``ChunkRun`` the transfer model (``transfer.KVTransferModel``)
times as it times a chunk: ``cached_tokens`` sent by ``|H|`` holders, starting and "ending"
(all layers ready, compute time 0) at chunk 0's start, ahead of the chunks on the receive link.
With ``c = 0`` the model's bound is ``max(start, link_free) + cached_tokens · bytes /
min(|H| · send, recv)``.

A decode instance that already holds the prefix (decode-side reuse, ``prefix_decode.py``)
receives no prefix shard: the caller passes ``streamed=False`` and the runs are unchanged.
"""

from __future__ import annotations

from tetris.plan import PrefillPlan
from tetris.sim.prefill import ChunkRun

__all__ = ["PREFIX_CHUNK", "prefix_shard", "with_prefix_shard"]

PREFIX_CHUNK = -1   # the live pool's chunk index of a cached prefix's shards


def prefix_shard(plan: PrefillPlan, runs: list[ChunkRun]) -> ChunkRun | None:
    """The pseudo-chunk streaming ``plan``'s cached prefix, or None (nothing cached)."""
    if not plan.cached_tokens or not runs:
        return None
    start = runs[0].start   # the holders copy (and stream) it when chunk 0's turn has come
    return ChunkRun(plan.request_id, PREFIX_CHUNK, tuple(plan.cached_instances), 0,
                    plan.cached_tokens, start, start, start, start)


def with_prefix_shard(plan: PrefillPlan, runs: list[ChunkRun], *,
                      streamed: bool = True) -> list[ChunkRun]:
    """The runs whose KV crosses to decode: the prefix's pseudo-chunk first (when streamed and
    cached), then the chunks; ``runs`` itself when nothing is added."""
    shard = prefix_shard(plan, runs) if streamed else None
    return runs if shard is None else [shard, *runs]
