"""KunServe §4.3: the attention-aware cost model and lookahead micro-batches."""

import numpy as np
import pytest

from tetris.scheduler.lookahead import (
    Chunk,
    CostModel,
    bubble_share,
    lookahead,
    token_budget_batches,
)

TRUTH = CostModel(alpha=1.2e-8, beta=0.7e-8, gamma=1.0e-4, delta=2.0e-3, epsilon=1.5e-3)


def _batch(rng, n_chunks, long):
    chunks = []
    for j in range(n_chunks):
        length = int(rng.integers(1000, 6000) if long else rng.integers(1, 512))
        prefix = int(rng.integers(0, 4000)) if j % 2 else 0
        chunks.append(Chunk(f"r{j}", prefix, length))
    return chunks


def _samples(rng, n, long):
    out = []
    for _ in range(n):
        b = _batch(rng, int(rng.integers(1, 6)), long)
        out.append((b, TRUTH.batch(b) * (1 + rng.normal(0, 0.01))))   # 1% measurement noise
    return out


def test_the_fit_predicts_held_out_batches_within_5_percent_and_linear_cannot():
    rng = np.random.default_rng(0)
    train = _samples(rng, 80, False) + _samples(rng, 80, True)
    model = CostModel.fit(train)
    held = _samples(np.random.default_rng(1), 60, True)
    err = max(abs(model.batch(b) - t) / t for b, t in held)
    assert err < 0.05
    # A token-linear model (NanoFlow-style: no attention terms) fitted on the same samples.
    rows = np.array([[sum(c.length for c in b), len(b), 1.0] for b, _ in train])
    coef, *_ = np.linalg.lstsq(rows, np.array([t for _, t in train]), rcond=None)
    linear = [abs(coef @ [sum(c.length for c in b), len(b), 1.0] - t) / t for b, t in held]
    assert max(linear) > 0.2


def _queue():
    long = [Chunk("long0", 0, 6000), Chunk("long1", 0, 4000)]
    return long + [Chunk(f"s{i}", 0, 300) for i in range(20)]


def _check_chunks(batches, queue):
    for req in queue:
        parts = [c for b in batches for c in b if c.request == req.request]
        assert sum(c.length for c in parts) == req.length
        prefix = req.prefix
        for c in parts:                       # in order, each after the one before
            assert c.prefix == prefix
            prefix += c.length


def test_lookahead_balances_cost_where_token_budgets_leave_bubbles():
    queue = _queue()
    total = sum(c.length for c in queue)
    ours = lookahead(queue, TRUTH, min_tokens=512, max_batches=4)
    theirs = token_budget_batches(queue, -(-total // 4))
    assert len(ours) == len(theirs) == 4
    _check_chunks(ours, queue)
    _check_chunks(theirs, queue)
    assert all(sum(c.length for c in b) >= 512 for b in ours)
    assert bubble_share(ours, TRUTH) < 0.02
    assert bubble_share(theirs, TRUTH) > max(0.1, 5 * bubble_share(ours, TRUTH))


@pytest.mark.parametrize("min_tokens", [3000, 8000])
def test_splitting_stops_at_the_token_threshold(min_tokens):
    queue = _queue()
    batches = lookahead(queue, TRUTH, min_tokens=min_tokens, max_batches=16)
    _check_chunks(batches, queue)
    assert len(batches) < 16
    assert all(sum(c.length for c in b) >= min_tokens // 2 for b in batches)
