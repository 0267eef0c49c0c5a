"""A dropped group's round from lookahead micro-batches (KunServe §4.3), and the simulator's
use of it: the bubble is computed from the micro-batches, not the paper's 8.3% input."""

import msgspec
import numpy as np
import pytest

from tetris.control.drop_plan import Group, split_layers
from tetris.scheduler.lookahead import Chunk, CostModel, lookahead
from tetris.sim.kunserve import KunRequest, KunServeSim, iteration_time, unit_time
from tetris.sim.kunserve_pipeline import (
    decode_cost_model,
    decode_micro_batches,
    group_round,
    pipeline_round,
)
from tetris.sim.kunserve_workload import load_profile, profile_path

MEM, PROF = load_profile(profile_path("qwen2.5-14b-tp1"))


def _contexts(n, seed=0):
    """Decode contexts of a BurstGPT-like running batch in admission order: lognormal prompts
    around 640 tokens, plus the output so far, longer for the earlier admitted."""
    rng = np.random.default_rng(seed)
    prompts = np.minimum(3000, rng.lognormal(np.log(640) - 0.5, 1.0, n) + 1)
    return [int(p) + 2 * (n - i) for i, p in enumerate(prompts)]


def test_the_decode_cost_model_is_the_instance_step_time():
    ctx = _contexts(300)
    model = decode_cost_model(MEM, PROF)
    chunks = [Chunk(str(i), c, 1) for i, c in enumerate(ctx)]
    assert model.batch(chunks) == pytest.approx(iteration_time(MEM, PROF, 1, 300, sum(ctx)))
    assert unit_time(MEM, PROF, (48,), ctx) == iteration_time(MEM, PROF, 1, 300, sum(ctx))


def test_the_cyclic_pipeline_round_and_its_bubble():
    # Two members, two micro-batches costing 1 and 3 (half on each member), no hop: a
    # member works 2 per round, but micro-batch 1 needs 1.5 + 1.5 = 3 to come round again.
    seconds, bubble = pipeline_round([[0.5, 1.5], [0.5, 1.5]], [0.0, 0.0])
    assert seconds == pytest.approx(3.0) and bubble == pytest.approx(1 - 4 / 6)
    # Equal micro-batches fill both members: the round is one member's work, no bubble.
    seconds, bubble = pipeline_round([[1.0, 1.0], [1.0, 1.0]], [0.0, 0.0])
    assert seconds == pytest.approx(2.0) and bubble == pytest.approx(0.0)
    # A hop of h per member lengthens each micro-batch's cycle to 2 + 2h.
    seconds, _ = pipeline_round([[1.0, 1.0], [1.0, 1.0]], [0.25, 0.25])
    assert seconds == pytest.approx(2.5)


@pytest.mark.parametrize("g", [2, 3, 4])
def test_lookahead_micro_batches_leave_a_smaller_bubble_than_token_budgets(g):
    ctx = _contexts(200 * g, seed=g)
    layers = split_layers(48, g)
    ours = group_round(MEM, PROF, [e - s for s, e in layers], ctx)
    theirs = group_round(MEM, PROF, [e - s for s, e in layers], ctx, balanced=False)
    assert len(ours.batches) == len(theirs.batches) == g
    assert sorted(c.request for b in ours.batches for c in b) == sorted(map(str, range(len(ctx))))
    costs = [decode_cost_model(MEM, PROF).batch(b) for b in ours.batches]
    one = max(decode_cost_model(MEM, PROF).chunk(Chunk("x", c, 1)) for c in ctx)
    assert max(costs) - min(costs) <= 2 * one      # balanced to a sequence either side
    assert ours.bubble < 0.02 and theirs.bubble > 1.5 * ours.bubble
    assert ours.seconds < theirs.seconds
    assert ours.seconds < iteration_time(MEM, PROF, g, len(ctx), sum(ctx))   # fixed 8.3%


def test_a_split_accounts_for_the_weights_each_micro_batch_loads():
    """Eq. (2): two micro-batches load the weights twice; cutting at half the whole's cost
    would leave the right half one epsilon costlier."""
    model = CostModel(alpha=1e-6, beta=0.0, gamma=1e-4, delta=0.015, epsilon=0.015)
    chunks = [Chunk(str(i), 500 + 7 * i, 1) for i in range(400)]
    left, right = lookahead(chunks, model, min_tokens=8, max_batches=2)
    assert abs(model.batch(left) - model.batch(right)) <= model.chunk(chunks[-1])
    three = lookahead(chunks, model, min_tokens=8, max_batches=3)
    assert [c for b in three for c in b] == chunks
    costs = [model.batch(b) for b in three]
    assert max(costs) - min(costs) <= 2 * model.chunk(chunks[-1])


def test_too_few_sequences_are_not_split_below_the_threshold():
    model = decode_cost_model(MEM, PROF)
    assert len(decode_micro_batches([100] * 10, model, 4)) == 1      # 10 < 2 x 8 tokens
    assert decode_micro_batches([], model, 4) == []


@pytest.mark.parametrize("round_model", ["lookahead", "token_budget", "fixed"])
def test_the_simulators_group_iteration_is_the_round_model(round_model):
    prof = msgspec.structs.replace(PROF, instances=2)
    reqs = [KunRequest(i, 0.0, c, 50) for i, c in enumerate(_contexts(300, seed=7))]
    sim = KunServeSim(reqs, MEM, prof, "kunserve", round_model=round_model)
    sim.control.groups = [Group((0, 1), split_layers(48, 2))]
    sim._regroup(0.0, [(0, 1)])
    (pair,) = sim.units
    assert pair.layers == (24, 24)
    for r in reqs:
        r.generated, r.blocks, r.unit, r.stalled_until = 1, sim._blocks(r.tokens + 1), pair, 0.0
        pair.running.append(r)
        pair.used += r.blocks
    sim._start(0.0, pair)
    contexts = [r.tokens for r in reqs]
    expected = {"lookahead": group_round(MEM, prof, (24, 24), contexts).seconds,
                "token_budget": group_round(MEM, prof, (24, 24), contexts, balanced=False).seconds,
                "fixed": iteration_time(MEM, prof, 2, len(reqs), sum(contexts))}[round_model]
    assert pair.step_end == pytest.approx(expected)
