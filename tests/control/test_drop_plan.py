"""KunServe §4.1 drop plans and §4.4 restore plans: invariants 1, 2 and 6."""

import pytest

from tests.control.kunserve_profiles import even6, qwen14b_tp1, served_tiny
from tetris.control.drop_plan import (
    DropRefused,
    Group,
    check_group,
    group_kv_blocks,
    plan_drop,
    plan_forced,
    plan_restore,
    split_layers,
)


def _assert_tiles_all_layers(group, num_layers):
    layers = [layer for s, e in group.layer_ranges for layer in range(s, e)]
    assert layers == list(range(num_layers))            # union = all, no overlap, in order


def test_one_merge_when_one_copy_covers_the_demand():
    mem = qwen14b_tp1()
    gain = mem.group_kv_blocks([24, 24]) - 2 * mem.kv_blocks
    plan = plan_drop(mem, range(8), demand_blocks=gain, free_blocks=0)
    assert plan.merges == 1
    assert [g.members for g in plan.groups] == [(0, 1), (2,), (3,), (4,), (5,), (6,), (7,)]
    assert plan.groups[0].layer_ranges == ((0, 24), (24, 48))
    assert plan.kv_blocks_after - plan.kv_blocks_before == gain
    assert plan.freed_param_bytes == mem.layers_param_bytes
    # One block more of demand needs a second merge, of the two next-smallest (2 and 3).
    plan2 = plan_drop(mem, range(8), demand_blocks=gain + 1, free_blocks=0)
    assert plan2.merges == 2
    assert [g.members for g in plan2.groups][:2] == [(0, 1), (2, 3)]


def test_merges_stop_as_soon_as_the_demand_is_covered_and_pairs_come_first():
    mem = qwen14b_tp1()
    pair_gain = mem.group_kv_blocks([24, 24]) - 2 * mem.kv_blocks
    plan = plan_drop(mem, range(8), demand_blocks=4 * pair_gain, free_blocks=0)
    assert plan.merges == 4
    assert [g.size for g in plan.groups] == [2, 2, 2, 2]
    for g in plan.groups:
        _assert_tiles_all_layers(g, 48)
    # More demand merges pairs into groups of 4 (the two smallest each time).
    plan5 = plan_drop(mem, range(8), demand_blocks=4 * pair_gain + 1, free_blocks=0)
    assert plan5.merges == 5 and sorted(g.size for g in plan5.groups) == [2, 2, 4]


@pytest.mark.parametrize("g", [2, 3])
def test_invariant_2_group_capacity_grows_by_freed_bytes_over_block_bytes(g):
    mem = even6()
    group = Group(tuple(range(g)), split_layers(6, g))
    grown = group_kv_blocks(mem, group) - g * mem.kv_blocks
    assert grown * mem.block_bytes == (g - 1) * mem.layers_param_bytes
    assert grown == (g - 1) * 10


def test_14b_group_capacity_is_the_floor_of_kv_plus_freed_bytes():
    mem = qwen14b_tp1()
    for g in (2, 3, 4):
        held = [48 // g] * g
        expected = (g * mem.kv_bytes + (g - 1) * mem.layers_param_bytes) // mem.block_bytes
        assert mem.group_kv_blocks(held) == expected


def test_a_plan_that_would_lose_the_last_copy_is_refused():
    mem = even6()
    with pytest.raises(DropRefused, match="last copy"):
        plan_drop(mem, range(2), demand_blocks=10_000, free_blocks=0)
    with pytest.raises(DropRefused, match=r"layers \[4, 6\) would lose their last copy"):
        plan_forced(mem, [Group((0, 1), ((0, 2), (2, 4)))])
    with pytest.raises(DropRefused, match="overlapping"):
        check_group(Group((0, 1), ((0, 4), (3, 6))), 6)
    with pytest.raises(DropRefused, match="two groups"):
        plan_forced(mem, [Group((0, 1), split_layers(6, 2)), Group((1, 2), split_layers(6, 2))])
    with pytest.raises(DropRefused, match="at least one of 6 layers"):
        split_layers(6, 7)


def test_restore_pulls_exactly_the_dropped_layers_from_their_keepers():
    mem = even6()
    group = Group((3, 5, 7), split_layers(6, 3))
    plan = plan_restore(mem, [group, Group((1,), ((0, 6),))])
    assert [g.members for g in plan.groups] == [(1,), (3,), (5,), (7,)]
    for dst in group.members:
        got = sorted((p.start, p.end, p.src) for p in plan.pulls if p.dst == dst)
        kept = group.layer_ranges[group.members.index(dst)]
        layers = sorted([x for s, e, _ in got for x in range(s, e)] + list(range(*kept)))
        assert layers == list(range(6))                  # pulled + kept: all, none twice
        assert all(group.owner_of(s) == src for s, _, src in got)
    assert plan.pulled_param_bytes == 2 * mem.layers_param_bytes     # (g - 1) copies


def test_an_idle_pool_merges_the_fewest_instances_that_hold_a_request_larger_than_one():
    mem = even6()        # 100 blocks per instance, a pair takes 210, a triple 320
    idle = {"demand_blocks": 150, "free_blocks": 400}     # the pool's free blocks cover it
    assert plan_drop(mem, range(4), **idle).merges == 0  # fit 0: as before
    plan = plan_drop(mem, range(4), **idle, fit_blocks=150)
    assert plan.merges == 1 and [g.members for g in plan.groups] == [(0, 1), (2,), (3,)]
    plan = plan_drop(mem, range(4), **idle, fit_blocks=211)
    assert plan.merges == 2 and [g.members for g in plan.groups] == [(0, 1, 2), (3,)]
    assert plan.groups[0].layer_ranges == ((0, 2), (2, 4), (4, 6))
    assert plan_drop(mem, range(4), **idle, fit_blocks=100).merges == 0   # one instance holds it
    # a grouping already holding it is not merged further
    pair = plan_drop(mem, range(4), **idle, fit_blocks=150).groups
    assert plan_drop(mem, pair, **idle, fit_blocks=210).merges == 0


def test_a_request_no_grouping_holds_is_refused_with_the_reason():
    # four members of 6 layers hold 2, 2, 1, 1: the group takes what a 2-layer member holds
    with pytest.raises(DropRefused, match=r"a request of 321 blocks fits no unit \(the largest "
                       r"takes 320\) with one group left"):
        plan_drop(even6(), range(4), demand_blocks=0, free_blocks=400, fit_blocks=321)
    # served: a request takes one member's part (44 of a pair's 88), landed whole
    served = served_tiny()
    assert plan_drop(served, range(2), demand_blocks=38, free_blocks=64,
                     fit_blocks=38).merges == 1
    with pytest.raises(DropRefused, match=r"fits no unit \(the largest takes 44\)"):
        plan_drop(served, range(2), demand_blocks=45, free_blocks=64, fit_blocks=45)
    with pytest.raises(DropRefused, match="largest takes 32"):   # no landing zone
        plan_drop(served_tiny(0), range(2), demand_blocks=38, free_blocks=64, fit_blocks=38)
