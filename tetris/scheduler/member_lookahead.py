"""Lookahead micro-batches for one member of a served KunServe group (§4.3, issue #24 item 5).

In a served group every member drives its own batch through the chain of stages
(``actors/decode/stage_chain.py``): with one micro-batch per member, g members keep g stages
busy only when their batches cost about the same. When one member's batch outweighs the
others' (an uneven placement, a peer that has little left to decode), its step is the whole
model's time on one micro-batch while every other stage idles: a bubble. That member cuts its
batch into micro-batches of equal predicted cost (``lookahead``, Eq. (1)-(2) over decode
chunks), so that the next stage runs one while its own stage runs the next.

How many: enough to fill the pipeline's g stages with the group's work. A member whose
predicted batch cost is ``own`` among peers whose latest batches cost ``peers`` forms
``k = ceil(g * own / (own + sum(peers)))`` micro-batches (at most g): equal batches keep one
each (the pipeline is already full), a member alone in the group forms g. Splitting costs a
weight load per micro-batch (Eq. (2)'s ``epsilon``; on a served member also its hops), so
fewer are formed where that outweighs the overlap (``micro_batch_count``), and
``min_tokens`` keeps micro-batches from getting too small.

Pure: the cost model and the formation; the actor side measures the peers' load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from tetris.scheduler.lookahead import Chunk, CostModel, lookahead, token_budget_batches

__all__ = ["MemberLookahead", "decode_cost_model", "micro_batch_count", "micro_batch_rows"]


class MemberLookahead(msgspec.Struct, frozen=True):
    """A member's micro-batch formation: ``cost`` (Eq. (1)-(2)), the §4.3 threshold
    ``min_tokens`` (a decode chunk is one token), ``balanced`` (lookahead; False: equal
    sequence counts, the token-budget baseline), ``count`` (a fixed number of micro-batches
    instead of the one the group's load asks for)."""

    cost: CostModel
    min_tokens: int = 1
    balanced: bool = True
    count: int | None = None


def decode_cost_model(hidden_size: int, layer_params: int, overhead_seqs: float) -> CostModel:
    """Eq. (1)-(2) for decode chunks of a model of ``layer_params`` parameters per layer, in
    units of one sequence's matmul work: a token costs ``2 * layer_params`` flops per layer
    (``gamma = 1``) and attends each context token with ``4 * hidden_size`` flops (q.k and
    p.v over the query heads: ``alpha = 2 hidden / layer_params``); a micro-batch pays a fixed
    ``overhead_seqs`` (weights read, launch and the hops: ``delta = epsilon``). No ``beta``:
    one new token per chunk."""
    if layer_params <= 0 or overhead_seqs < 0:
        raise ValueError(f"need positive layer_params and overhead, got {layer_params}, "
                         f"{overhead_seqs}")
    return CostModel(alpha=2.0 * hidden_size / layer_params, beta=0.0, gamma=1.0,
                     delta=overhead_seqs, epsilon=overhead_seqs)


def micro_batch_count(own: float, peers: Sequence[float], g: int, epsilon: float = 0.0) -> int:
    """Micro-batches that fill ``g`` stages with this member's share of the group's work, no
    more than pay for themselves: k micro-batches of a batch costing ``own`` (Eq. (2), one
    load) cost ``c = (own + (k - 1) epsilon) / k`` each and leave the pipeline after
    ``(k + g - 1) c / g`` (fill and drain: a step samples every row before the next starts),
    so the count is the one of least such time up to the share's."""
    total = own + sum(peers)
    if not (own > 0 and math.isfinite(own) and math.isfinite(epsilon)):
        return 1   # nothing to split, or a load per micro-batch no split can pay for
    share = max(1, min(g, math.ceil(g * own / total - 1e-9)))
    return min(range(1, share + 1), key=lambda k: (k + g - 1) * (own + (k - 1) * epsilon) / k)


def micro_batch_rows(contexts: Sequence[int], plan: MemberLookahead, g: int,
                     peers: Sequence[float]) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` of a decode batch (one row per sequence, ``contexts`` its
    context lengths, in batch order) as micro-batches, in order, covering every row once."""
    n = len(contexts)
    chunks = [Chunk(str(i), int(c), 1) for i, c in enumerate(contexts)]
    k = plan.count if plan.count is not None else micro_batch_count(
        plan.cost.batch(chunks), peers, g, plan.cost.epsilon)
    k = max(1, min(k, n))
    if k == 1:
        return [(0, n)] if n else []
    if plan.balanced:
        batches = lookahead(chunks, plan.cost, min_tokens=plan.min_tokens, max_batches=k)
    else:
        batches = token_budget_batches(chunks, -(-n // k))
    rows, lo = [], 0
    for b in batches:   # decode chunks are one token: never cut, so each is whole rows
        rows.append((lo, lo + len(b)))
        lo += len(b)
    return rows
