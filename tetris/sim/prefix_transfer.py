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

A moved prefix (``PrefillPlan.cached_moved``, issue #23's "move") lies on chunk 0's group
``G`` when chunk 0 starts: ``G`` streams it, not the holders. The move itself is charged before
chunk 0 (``move_landing``): on the plane's link model (``ControlPlane.prefix_move``,
``tetris.scheduler.prefix_move``), the price the planner used, counted from the plan's
arrival (the source's prefill has finished: the planner offers a move only then). The
holders send from their transfer thread, so their compute is not charged; the move's bytes
are not queued against other transfers on the same NICs (a simplification).

A decode instance that already holds the prefix (decode-side reuse, ``prefix_decode.py``)
receives no prefix shard: the caller passes ``streamed=False`` and the runs are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from tetris.plan import PrefillPlan
from tetris.sim.prefill import ChunkRun

__all__ = ["PREFIX_CHUNK", "move_landing", "prefix_shard", "with_prefix_shard"]

PREFIX_CHUNK = -1   # the live pool's chunk index of a cached prefix's shards


def prefix_shard(plan: PrefillPlan, runs: list[ChunkRun]) -> ChunkRun | None:
    """The pseudo-chunk streaming ``plan``'s cached prefix, or None (nothing cached)."""
    if not plan.cached_tokens or not runs:
        return None
    start = runs[0].start   # the holders copy (and stream) it when chunk 0's turn has come
    # moved: chunk 0's group holds it by then (spread over it) and streams it
    senders = plan.chunks[0].instances if plan.cached_moved else plan.cached_instances
    return ChunkRun(plan.request_id, PREFIX_CHUNK, tuple(senders), 0,
                    plan.cached_tokens, start, start, start, start)


def with_prefix_shard(plan: PrefillPlan, runs: list[ChunkRun], *,
                      streamed: bool = True) -> list[ChunkRun]:
    """The runs whose KV crosses to decode: the prefix's pseudo-chunk first (when streamed and
    cached), then the chunks; ``runs`` itself when nothing is added."""
    shard = prefix_shard(plan, runs) if streamed else None
    return runs if shard is None else [shard, *runs]


def move_landing(plan: PrefillPlan, arrival: float, move, node_of: Sequence[int]) -> float:
    """When chunk 0 may start at the earliest: ``arrival``, or for a moved prefix when its KV
    has landed on chunk 0's group (``move``: the plane's ``PrefixMove``)."""
    if not plan.cached_moved:
        return arrival
    if move is None:
        raise ValueError(f"plan {plan.request_id} moves its prefix but no link model prices it")
    return arrival + move.seconds(plan.cached_tokens, plan.cached_instances,
                                  plan.chunks[0].instances, node_of)
