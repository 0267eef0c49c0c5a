"""The served dispatcher plans a hit with ``[prefix_cache] placement``: "move" moves the prefix
to a first group without its holders (the control plane's link model from the deployment),
"extend" grows the holders' group; the fake pools of test_dispatcher_prefix record the plans."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tests.serve.test_dispatcher_prefix import DOC, Decode, Prefill, _req, _run
from tetris.config import PrefixCacheConfig, load_deployment
from tetris.scheduler.prefix_move import PrefixMove
from tetris.serve.dispatcher import Dispatcher
from tetris.serve.metrics import ServingMetrics


def _plans(placement: str):
    dep = load_deployment(None)
    dep = msgspec.structs.replace(dep, prefix_cache=PrefixCacheConfig(
        enabled=True, block_tokens=16, capacity_blocks=256, placement=placement))
    prefill = Prefill()
    d = Dispatcher(dep, prefill, Decode(), node_of=[0, 0, 1, 1, 2, 2, 3, 3],
                   decode_capacities=[1 << 20], metrics=ServingMetrics("tiny", requests=False))

    async def scenario():
        await _run(d, _req("q1", DOC + [700]))
        await _run(d, _req("q2", DOC + [800, 801]))

    asyncio.run(scenario())
    return dep, d, prefill.plans["q1"], prefill.plans["q2"]


@pytest.mark.parametrize("placement", ["move", "extend"])
def test_the_configured_placement_reaches_the_plan(placement):
    dep, d, first, second = _plans(placement)
    plan = second.validate(8)
    assert plan.cached_tokens == 592 and plan.cached_instances == first.instances
    holders, group = set(first.instances), set(plan.chunks[0].instances)
    assert d.control.last_prefix.decision == placement
    if placement == "extend":
        assert not plan.cached_moved
        assert plan.chunks[0].instances[:len(holders)] == first.instances
        return
    assert plan.cached_moved and not holders & group
    # priced on the deployment's model and [sp_layout] links, from the plan's arrival on
    move = PrefixMove.from_deployment(dep)
    move_s = move.seconds(592, first.instances, plan.chunks[0].instances,
                          [0, 0, 1, 1, 2, 2, 3, 3])
    assert d.control.last_prefix.move_s == move_s > 0
    # the move starts when q2 is planned, after q1 was
    assert plan.chunks[0].expected_start - move_s >= first.chunks[0].expected_start


def test_tp_prefill_instances_are_offered_a_move_priced_per_rank():
    """TP > 1 prefill instances move their KV heads rank by rank (the pool runs it:
    test_pool_tp): the served planner prices it on one rank's heads and links."""
    from tetris.serve.prefix_cache import make_move

    dep = load_deployment(None)
    tp2 = msgspec.structs.replace(dep, prefill=msgspec.structs.replace(dep.prefill, tp_size=2))
    one, two = make_move(dep), make_move(tp2)
    assert one is not None and two is not None
    assert two.kv_bytes(592) * 2 == one.kv_bytes(592)
