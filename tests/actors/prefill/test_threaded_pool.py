"""The in-process prefill pool (actors/prefill/threaded.py) equals the single instance."""

from __future__ import annotations

import pytest

from cdsp_check import check_plan, prompt
from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.kv_store import KVCapacityError
from tetris.actors.prefill.threaded import ThreadedPool
from tetris.plan import PlanError


@pytest.fixture(scope="module")
def local_pool(model):
    return ThreadedPool(model, 4, num_blocks=64, block_size=16, timeout_s=20.0)


@pytest.mark.parametrize("n,spec,balance", [
    (300, "300x1", "overlap"),
    (700, "200x1,200x2,restx4", "overlap"),
    (701, "233x2,restx3", "blocking"),
    (500, "100x1,restx4", "off"),
])
def test_threaded_plans_match_single_instance(local_pool, model, n, spec, balance):
    plan = forced_plan(f"th-{spec}-{balance}", n, spec, (0, 0, 1, 1))
    assert local_pool.backend == "gloo"   # CPU ranks: the seam picks gloo, no staging
    res = check_plan(local_pool, model, plan, prompt(n, n), balance=balance)
    assert (res.balance_moved_tokens > 0) == (balance != "off" and len(plan.chunks) > 1
                                              and len(plan.chunks[-1].instances) > 1)
    local_pool.release(plan.request_id)
    assert all(not s.requests() for s in local_pool.stores)


def test_bad_input_is_refused_and_nothing_is_held(local_pool):
    plan = forced_plan("bad", 100, "100x2", (0, 0, 1, 1))
    with pytest.raises(ValueError, match="the prompt has 99"):
        local_pool.run(plan, prompt(99, 0))
    with pytest.raises(PlanError):
        local_pool.run(forced_plan("big", 100, "100x8", tuple(range(8))), prompt(100, 0))
    too_long = forced_plan("long", 64 * 16 * 4 + 16, "restx4", (0, 0, 1, 1))
    with pytest.raises(KVCapacityError, match="65 blocks, 64 free"):
        local_pool.run(too_long, prompt(too_long.prompt_tokens, 1))
    assert all(not s.requests() for s in local_pool.stores)
