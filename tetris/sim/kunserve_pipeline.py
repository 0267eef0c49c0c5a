"""A dropped group's decode round, from the micro-batches lookahead forms (KunServe §4.3).

A group of g members runs its batch as a pipeline: member s holds ``layers[s]`` of the L
layers, a micro-batch runs member 0's layers, hops its hidden states to member 1, and so on;
the last member samples and the micro-batch's next token starts again at member 0. One
*round* is the time in which every micro-batch advances one token (every request of the
unit decodes once), so it is the unit's iteration time, the TPOT its requests see.

Costs come from the profile's instance model, ``T(b, ctx) = params/hbm + b per_seq + ctx
kv_tok/hbm`` (``tetris/sim/kunserve.py``), written as the §4.3 cost model Eq. (1)-(2) of a
decode chunk (one new token after ``prefix`` = its context): ``alpha = kv_tok/hbm``,
``gamma = per_seq``, ``delta = epsilon = params/hbm`` (each micro-batch loads the weights
once, Eq. (2)'s shared term), ``beta = 0`` (one new token: no quadratic term). Member s runs
``layers[s]/L`` of a micro-batch's cost (weights, per-sequence work and KV all scale with the
layers held).

The round is the steady state of the cyclic pipeline (each member takes the micro-batches in
order; micro-batch i enters member s when member s is free and micro-batch i has left member
s-1 and crossed the link), and the *bubble* is what it leaves idle:
``1 - sum of stage work / (g * round)`` (the paper's "ratio of idle GPU cycles", §6.4). It is
computed from the micro-batches, not taken as an input: micro-batches balanced by cost
(``lookahead``) leave a smaller bubble than equal token counts (``token_budget_batches``,
the vLLM-PP baseline) whenever contexts differ.
"""

from __future__ import annotations

from collections.abc import Sequence

from tetris.control.kunserve_memory import InstanceMemory
from tetris.scheduler.lookahead import Chunk, CostModel, lookahead, token_budget_batches

__all__ = ["MIN_TOKENS", "PipelineRound", "decode_cost_model", "decode_micro_batches",
           "group_round", "pipeline_round"]

# Lookahead stops halving below this many tokens per micro-batch (a decode chunk is one
# token): below it a member runs too few sequences to keep its GPU busy (§4.3's threshold).
MIN_TOKENS = 8
# Rounds of the cyclic schedule to reach its steady state, and rounds averaged over.
_WARM, _MEASURE = 3, 2


class PipelineRound:
    """One steady-state round: its seconds, the bubble share it leaves, its micro-batches."""

    __slots__ = ("batches", "bubble", "seconds")

    def __init__(self, seconds: float, bubble: float, batches: list[list[Chunk]]) -> None:
        self.seconds, self.bubble, self.batches = seconds, bubble, batches


def decode_cost_model(mem: InstanceMemory, prof) -> CostModel:
    """The profile's instance model as Eq. (1)-(2) for decode chunks (module docstring):
    ``model.batch`` of a whole batch is exactly ``T(b, ctx)``."""
    weights = mem.param_bytes / prof.hbm_bytes_per_s
    kv_tok = mem.block_bytes / mem.block_size
    return CostModel(alpha=kv_tok / prof.hbm_bytes_per_s, beta=0.0, gamma=prof.per_seq_s,
                     delta=weights, epsilon=weights)


def decode_micro_batches(contexts: Sequence[int], model: CostModel, g: int, *,
                         balanced: bool = True) -> list[list[Chunk]]:
    """Micro-batches of one decode token per sequence (``prefix`` = the sequence's context,
    whose KV the token reads; in the unit's order). ``balanced``: §4.3's lookahead into g
    micro-batches of equal predicted cost (fewer where a part would hold fewer than
    ``MIN_TOKENS``); otherwise the token-budget baseline, g micro-batches of equal sequence
    counts."""
    chunks = [Chunk(str(i), c, 1) for i, c in enumerate(contexts)]
    if not chunks:
        return []
    if not balanced:
        return token_budget_batches(chunks, -(-len(chunks) // g))
    return lookahead(chunks, model, min_tokens=MIN_TOKENS, max_batches=g)


def pipeline_round(stage_s: Sequence[Sequence[float]], hop_s: Sequence[float]) -> tuple[float, float]:
    """(round seconds, bubble share) of the steady cyclic schedule where ``stage_s[s][i]`` is
    micro-batch i's time on member s and ``hop_s[i]`` its activation hop between members
    (also back from the last member to the first, with the sampled tokens)."""
    g, m = len(stage_s), len(hop_s)
    free = [0.0] * g               # when each member finishes its current micro-batch
    ready = [0.0] * m              # when each micro-batch may enter member 0
    ends = []
    for _ in range(_WARM + _MEASURE):
        for i in range(m):
            t = ready[i]
            for s in range(g):
                t = max(t, free[s]) + stage_s[s][i]
                free[s] = t
                t += hop_s[i]
            ready[i] = t
        ends.append(max(free))
    period = (ends[-1] - ends[-1 - _MEASURE]) / _MEASURE
    work = sum(sum(row) for row in stage_s)
    return period, max(0.0, 1.0 - work / (g * period)) if period > 0 else 0.0


def group_round(mem: InstanceMemory, prof, layers: Sequence[int], contexts: Sequence[int], *,
                balanced: bool = True) -> PipelineRound:
    """A group's round over sequences holding ``contexts`` tokens, members holding ``layers``
    (micro-batches by lookahead, or by token budget when not ``balanced``)."""
    model = decode_cost_model(mem, prof)
    batches = decode_micro_batches(contexts, model, len(layers), balanced=balanced)
    if not batches:
        return PipelineRound(0.0, 0.0, [])
    total = sum(layers)
    costs = [model.batch(b) for b in batches]
    stage_s = [[c * n / total for c in costs] for n in layers]
    hop_s = [sum(c.length for c in b) * prof.activation_bytes_per_token / prof.link_bytes_per_s
             for b in batches]
    seconds, bubble = pipeline_round(stage_s, hop_s)
    return PipelineRound(seconds, bubble, batches)
