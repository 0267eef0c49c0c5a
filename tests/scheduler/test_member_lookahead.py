"""A served member's micro-batches (tetris/scheduler/member_lookahead.py): how many by the
group's load, and cost-balanced rows against equal counts on an uneven batch."""

import itertools

import pytest

from tetris.scheduler.lookahead import Chunk
from tetris.scheduler.member_lookahead import (
    MemberLookahead,
    decode_cost_model,
    micro_batch_count,
    micro_batch_rows,
)

# Contexts of an uneven decode batch: a few long requests first, many short ones after.
CONTEXTS = [4000, 3500, 3000] + [200] * 13
COST = decode_cost_model(hidden_size=1024, layer_params=1_000_000, overhead_seqs=1.0)


def test_count_fills_the_stages_with_the_members_share():
    assert micro_batch_count(10.0, [10.0, 10.0], 3) == 1     # equal batches: one each
    assert micro_batch_count(10.0, [], 3) == 3               # alone in the group: g
    assert micro_batch_count(10.0, [0.5], 2) == 2            # the peer has little work
    assert micro_batch_count(10.0, [10.0], 2) == 1           # exactly half of 2 stages
    assert micro_batch_count(10.0, [2.0, 3.0], 3) == 2       # 2/3 of the work of 3 stages
    assert micro_batch_count(0.0, [], 3) == 1


def test_count_stops_where_a_micro_batchs_load_outweighs_the_overlap():
    # alone in a group of 2, a batch of cost 10: k = 2 takes (3/2)(10 + eps)/2
    assert micro_batch_count(10.0, [], 2, epsilon=3.0) == 2      # 9.75 < 10
    assert micro_batch_count(10.0, [], 2, epsilon=4.0) == 1      # 10.5 > 10
    assert micro_batch_count(10.0, [], 4, epsilon=5.0) == 2      # k=1..3: 10, 9.375, 10
    assert micro_batch_count(10.0, [10.0], 2, epsilon=0.0) == 1  # the share caps it
    assert micro_batch_count(10.0, [], 2, epsilon=float("inf")) == 1   # never pays
    assert micro_batch_count(float("nan"), [], 2) == 1


def test_cost_model_charges_context_and_a_load_per_micro_batch():
    # alpha = 2 * 1024 / 1e6 per context token; gamma = 1 per sequence; delta = epsilon = 1
    one = COST.batch([Chunk("a", 6000, 1)])
    assert one == pytest.approx(6000 * 2048 / 1e6 + 1 + 1)
    assert COST.batch([Chunk("a", 0, 1), Chunk("b", 0, 1)]) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        decode_cost_model(1024, 0, 1.0)


def _imbalance(rows):
    costs = [COST.batch([Chunk(str(i), CONTEXTS[i], 1) for i in range(lo, hi)])
             for lo, hi in rows]
    return max(costs) / min(costs)


@pytest.mark.parametrize("k", [2, 3])
def test_balanced_rows_cover_the_batch_and_beat_equal_counts(k):
    balanced = micro_batch_rows(CONTEXTS, MemberLookahead(COST, count=k), k, [])
    counted = micro_batch_rows(CONTEXTS, MemberLookahead(COST, count=k, balanced=False), k, [])
    for rows in (balanced, counted):
        assert rows[0][0] == 0 and rows[-1][1] == len(CONTEXTS) and len(rows) == k
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(rows))
    assert counted[0] == (0, -(-len(CONTEXTS) // k))
    assert balanced != counted
    # whole sequences only (a decode chunk is one token): balanced as far as rows allow
    assert _imbalance(balanced) < 1.8 and _imbalance(counted) > 2.5


def test_rows_follow_the_groups_load_and_the_threshold():
    plan = MemberLookahead(COST)
    own = COST.batch([Chunk(str(i), c, 1) for i, c in enumerate(CONTEXTS)])
    assert micro_batch_rows(CONTEXTS, plan, 2, [own]) == [(0, 16)]       # peer as busy
    assert len(micro_batch_rows(CONTEXTS, plan, 2, [])) == 2             # peer idle
    # a part under 2 * min_tokens tokens stays whole
    assert micro_batch_rows(CONTEXTS, MemberLookahead(COST, min_tokens=9), 2, []) == [(0, 16)]
    assert micro_batch_rows([], plan, 2, []) == []
