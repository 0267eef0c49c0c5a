"""KunServe's memory model and overload monitor on real instance sizes."""

import pytest

from tests.control.kunserve_profiles import GIB, even6, qwen14b_tp1, served_tiny
from tetris.control.kunserve_memory import InstanceLoad, OverloadMonitor


def test_14b_tp1_on_80gb_matches_the_papers_table_1_and_kv_cost():
    mem = qwen14b_tp1()
    # KunServe Table 1: parameters are 34.4% of an 80 GB GPU for Qwen-2.5-14B.
    assert 0.34 <= mem.param_bytes / (80 * GIB) <= 0.35
    assert mem.block_bytes // mem.block_size == 192 * 1024      # 192 KiB of KV per token
    # ~47 GB of KV left: ~240K tokens, the paper's "243K tokens per GPU" burst scale.
    assert 225_000 <= mem.kv_blocks * mem.block_size <= 250_000
    assert 27 * GIB <= mem.param_bytes <= 28 * GIB


def test_member_blocks_grow_by_the_dropped_layers_bytes():
    mem = qwen14b_tp1()
    half = mem.member_kv_blocks(24)
    # Formula of the module docstring, computed independently in bytes.
    expected = (mem.kv_bytes + 24 * mem.layer_param_bytes) // (24 * mem.layer_block_bytes)
    assert half == expected
    assert half > 2 * mem.kv_blocks        # half the layers per block, plus freed weights
    with pytest.raises(ValueError, match="1..48"):
        mem.member_kv_blocks(0)
    with pytest.raises(ValueError, match="each of the 48 layers once"):
        mem.group_kv_blocks([24, 23])


def test_group_capacity_is_the_smallest_member():
    mem = even6()
    assert mem.kv_blocks == 100
    assert mem.member_kv_blocks(3) == (600 * 4096 + 3 * 10 * 4096) // (3 * 4096) == 210
    assert mem.member_kv_blocks(4) == (600 + 20) * 4096 // (4 * 4096) == 155
    assert mem.group_kv_blocks([4, 2]) == 155
    assert mem.group_kv_blocks([3, 3]) == 210


def test_overload_needs_high_usage_and_a_queue_that_does_not_fit():
    mon = OverloadMonitor()
    mon.observe(0, InstanceLoad(total_blocks=1000, used_blocks=900, growth_blocks=10,
                                head_queued_blocks=120))
    mon.observe(1, InstanceLoad(total_blocks=1000, used_blocks=900, growth_blocks=10))
    mon.observe(2, InstanceLoad(total_blocks=1000, used_blocks=500, head_queued_blocks=200))
    mon.observe(3, InstanceLoad(total_blocks=1000, used_blocks=950, head_queued_blocks=40))
    # 0: demand 1030 >= 950 and pending 130 >= free 100; 1: nothing queued; 2: usage 70%;
    # 3: demand 990 >= 950 but its queue (40) fits in the 50 free blocks.
    assert mon.overloaded_instances() == [0]
    assert mon.demand_blocks([0, 1]) == (1030 + 910, 100 + 100)


def test_restore_waits_for_half_usage_and_an_empty_queue():
    mon = OverloadMonitor()
    mon.observe(0, InstanceLoad(total_blocks=500, used_blocks=90, growth_blocks=10))
    mon.observe(1, InstanceLoad(total_blocks=500, used_blocks=80))
    assert mon.can_restore(undropped_blocks=360, instances=[0, 1])      # 180 <= 180
    assert not mon.can_restore(undropped_blocks=358, instances=[0, 1])  # 180 > 179
    mon.observe(1, InstanceLoad(total_blocks=500, used_blocks=10, head_queued_blocks=1))
    assert not mon.can_restore(undropped_blocks=1000, instances=[0, 1])


def test_the_largest_request_a_unit_takes_is_its_capacity_or_on_the_served_pool_a_part():
    sim = even6()
    assert sim.request_blocks([6]) == 100 and sim.request_blocks([3, 3]) == 210
    served = served_tiny()          # the landing zone's 48 x 4 layer-blocks leave the region
    assert served.member_kv_blocks(2) == (128 + 2 * 120 - 48 * 4) // 2 == 88
    assert served.request_blocks([4]) == 32                 # undropped: no landing zone
    assert served.request_blocks([2, 2]) == 88 // 2         # a member's part of 88
    assert served_tiny(40).request_blocks([2, 2]) == 40     # at most the landing zone
    assert served_tiny(0).request_blocks([2, 2]) == 0       # no zone: takes no prefilled KV
