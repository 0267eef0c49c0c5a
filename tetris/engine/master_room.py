"""A split request's master gets its next block before a whole request does (issue #25).

The batcher protects its oldest requests by preempting the newest running sequence when a
decode needs a block and none is free (engine/batcher.py); the preempted one is recomputed
here later. A master of a split request (``kv_start`` > 0: its earlier KV is held by other
instances) cannot be recomputed here, so the batcher raises when the victim would be a master,
and a master admitted after a whole request is the newest. Before the engine steps,
``ElasticRows.round`` therefore frees blocks for the masters' decode rows by preempting the
newest *whole* running sequences, as the batcher would (tests/engine/
test_elastic_output_room.py). A master with a line hands over first (engine/
elastic_handover.py): no recompute at all.
"""

from __future__ import annotations

from tetris.engine.batcher import BatchPlan
from tetris.engine.elastic_handover import needs_block

__all__ = ["preempt_for_masters"]


def preempt_for_masters(engine) -> list[str]:
    """While the batch's decode rows need more new blocks than are free and a master is among
    them, preempt the newest running sequence that is not a master. Returns the preempted
    request ids (newest first); none when no master needs a block."""
    batcher, size = engine.batcher, engine.blocks.block_size
    decoding = [s for s in batcher.running if s.num_computed and s.num_uncomputed == 1]
    if not any(s.kv_start and needs_block(s, size) for s in decoding):
        return []
    need = sum(needs_block(s, size) for s in decoding)
    plan = BatchPlan(decodes=[], prefills=[], preempted=[])
    while not engine.blocks.make_room(need):
        whole = [s for s in batcher.running if not s.kv_start]
        if not whole:
            break   # only masters left: the batcher raises (or a holder was meant to take over)
        victim = whole[-1]
        need -= victim in decoding and needs_block(victim, size)
        batcher._preempt(victim, plan)
    return [s.request_id for s in plan.preempted]
