"""Elastic decode placement (tetris/control/elastic.py) on the paper's LLaMA3-8B decode side:
TP-8 A100 instances, the decode latency model, 200 Gb/s NICs per GPU."""

from __future__ import annotations

import pytest

from tetris.control.elastic import (
    DecodeGroup,
    ElasticConfig,
    ElasticPlacer,
    ExchangeModel,
    ShardRange,
)
from tetris.scheduler.decode_latency import LLAMA3_8B, DecodeLatencyModel
from tetris.scheduler.router import DecodeRouter

MODEL = DecodeLatencyModel(LLAMA3_8B)
CAP = MODEL.kv_capacity_tokens(8)
EXCHANGE = ExchangeModel(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)


def _placer(n=2, enabled=True, **cfg):
    router = DecodeRouter([CAP] * n)
    return ElasticPlacer(router, [CAP] * n, MODEL.step_time, 8, EXCHANGE,
                         ElasticConfig(enabled=enabled, **cfg))


def test_capacity_of_the_paper_instance():
    # (8 GPUs x 80 GB x 0.9 - 16.06 GB) / 131072 B per token
    assert CAP == int((8 * 80e9 * 0.9 - 16.06e9) // 131072) == 4_272_003


def test_off_it_is_the_routers_whole_request_choice():
    placer = _placer(enabled=False)
    placer.router.update(0, 700_000, 3)
    placer.router.update(1, 600_000, 1)
    group = placer.place("r", 1_000_000)   # fits nowhere: waits on the freest, as today
    assert group == DecodeGroup((ShardRange(1, 0, 1_000_000),))
    assert placer.router.virtual == [0, 1_000_000]


def test_memory_triggered_group_when_no_instance_has_room():
    placer = _placer(spread_for_time=False)
    placer.router.update(0, 700_000, 3)
    placer.router.update(1, 600_000, 1)
    group = placer.place("r", 1_000_000)
    # shares by room: instance 1 gets 1e6 * 600/1300, the freest (0) is master with the rest
    assert group.ranges == (ShardRange(1, 0, 461_538), ShardRange(0, 461_538, 1_000_000))
    assert group.master == 0 and group.sharded
    assert placer.router.virtual == [538_462, 461_538]
    placer.arrived("r")
    assert placer.router.virtual == [0, 0]
    placer.finished("r")
    assert placer.groups == {}


def test_more_than_the_sum_of_rooms_waits_whole_on_the_freest():
    placer = _placer()
    placer.router.update(0, 300_000, 0)
    placer.router.update(1, 200_000, 0)
    assert placer.choose(600_000) == DecodeGroup((ShardRange(0, 0, 600_000),))


def test_time_triggered_spread_follows_the_step_model():
    placer = _placer(n=4, max_group=2)
    whole = DecodeGroup((ShardRange(0, 0, 1_000_000),))
    t_whole = placer.group_step_time(whole)
    assert t_whole == pytest.approx(MODEL.step_time(8, 1, 1_000_000))
    group = placer.choose(1_000_000)
    assert group.ranges == (ShardRange(1, 0, 500_000), ShardRange(0, 500_000, 1_000_000))
    t_group = MODEL.step_time(8, 1, 500_000) + EXCHANGE.step_time(2)
    assert placer.group_step_time(group) == pytest.approx(t_group)
    assert t_group < 0.9 * t_whole   # 1M tokens on idle instances: 8.4 ms vs 12.8 ms
    # A 16K-token request gains less than the exchange costs: whole.
    assert not placer.choose(16_000).sharded
    # On a loaded instance pair a long request spreads onto the idle ones.
    placer.router.update(0, CAP - 2_000_000, 40)
    placer.router.update(1, CAP - 2_000_000, 40)
    assert placer.choose(1_000_000).instances == (2, 3)


def test_query_broadcast_against_moving_kv():
    # per step: 32 layers x (q 8 KiB + partial 8 KiB + LSE 128 B) to the one other holder
    assert EXCHANGE.step_bytes(2) == 32 * (8192 + 8192 + 128) == 528_384
    assert EXCHANGE.kv_bytes(500_000) == 500_000 * 131_072
    assert EXCHANGE.kv_bytes(500_000) / EXCHANGE.step_bytes(2) > 1e5   # csps-notes §2.5
    assert EXCHANGE.choose(remaining_steps=400, remote_tokens=500_000, holders=2) == "query"
    assert EXCHANGE.choose(remaining_steps=400, remote_tokens=100, holders=2) == "move_kv"


def test_consolidation_moves_a_small_range_once_the_master_has_room():
    placer = _placer(spread_for_time=False)
    placer.router.update(0, 1_000_000, 1)
    placer.router.update(1, 20_000, 1)
    group = placer.place("r", 1_010_000)
    placer.arrived("r")
    small = group.ranges[0]
    assert small.instance == 1 and small.tokens == 19_803
    # while the master is full there is nothing to do
    placer.router.update(0, 0, 2)
    assert placer.consolidation("r", remaining_steps=2_000) is None
    # others finish on the master: moving 19.8K tokens (2.6 GB, 13 ms) beats 2000 exchanges
    placer.router.update(0, 500_000, 1)
    assert placer.consolidation("r", remaining_steps=2_000) == small
    # nearly done: keep asking q (the holder, nearly full, slows the master's step by 5 ms,
    # so the 13 ms copy pays after 3 steps: tests/control/test_consolidation.py)
    assert placer.consolidation("r", remaining_steps=2) is None
    after = placer.moved("r", small)
    assert after.instances == (0,) and not after.sharded


def test_the_master_keeps_room_for_the_output():
    placer = _placer(spread_for_time=False)
    placer.router.update(0, 700_000, 0)
    placer.router.update(1, 600_000, 0)
    group = placer.choose(1_000_000, grow_tokens=200_000)
    # the 800K prompt tokens by room after the master's 200K: 500K : 600K
    assert group.ranges == (ShardRange(1, 0, 436_363), ShardRange(0, 436_363, 1_000_000))
    assert group.tokens_on(0) - 200_000 == 363_637
    # a master that cannot hold the output gives no group
    assert placer.candidate_groups(1_000_000, grow_tokens=800_000) == []


def test_no_spread_when_the_batches_involved_lose_more_than_the_request_gains():
    placer = _placer(n=2)
    for i in (0, 1):
        placer.router.update(i, CAP - 2_500_000, 60)
    whole = placer.choose(1_000_000)
    assert whole == DecodeGroup((ShardRange(0, 0, 1_000_000),))
    group = placer.candidate_groups(1_000_000)[0]
    assert group.ranges == (ShardRange(1, 0, 500_000), ShardRange(0, 500_000, 1_000_000))
    # the request's own step would be 12% shorter spread ...
    assert placer.group_step_time(group) < 0.9 * placer.group_step_time(whole)
    # ... but instance 1's 60 requests read 500K more tokens and instance 0's wait for them
    touched = (0, 1)
    assert placer.mean_step_time(group, touched) > placer.mean_step_time(whole, touched)


def test_losing_a_holder_names_every_run_with_a_range_there():
    placer = _placer(n=3, spread_for_time=False)
    placer.router.update(0, 700_000, 0)
    placer.router.update(1, 600_000, 0)
    placer.router.update(2, 100_000, 0)
    split = placer.place("split", 1_000_000)          # 1 holds a range, 0 is master
    whole = placer.place("small", 50_000)
    assert split.instances == (0, 1) and whole.instances == (0,)
    assert placer.runs_on(1) == ["split"]             # a holder's loss takes the request down
    assert placer.runs_on(0) == ["small", "split"]
    assert placer.runs_on(2) == []
    for run in placer.runs_on(1):                     # resume path: everything it held goes
        placer.finished(run)
    assert placer.router.virtual == [50_000, 0, 0]
