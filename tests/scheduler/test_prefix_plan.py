"""Planning from a cached prefix: only the suffix is planned, the prefix is Eq. 1's history, the
first group starts with the instances holding it, or the whole prompt is recomputed when that
is sooner; and the control plane wires the index through plan, prefill and finish."""

from __future__ import annotations

import pytest

from tetris.control import ControlPlane, PrefillQueue
from tetris.control.prefix_index import PrefixIndex
from tetris.plan import Chunk, PlanError, PrefillPlan
from tetris.scheduler.latency import load_profile
from tetris.scheduler.policies import make_policy
from tetris.scheduler.pool import PoolState
from tetris.scheduler.prefix_plan import plan_from_prefix
from tetris.scheduler.router import DecodeRouter


@pytest.fixture(scope="module")
def prof():
    return load_profile("a100-llama3-8b-tp1")


def test_a_cached_prefix_is_history_on_its_holders(prof):
    policy = make_policy("tetris", prof)
    pool = PoolState.uniform(8, 4)
    opt = plan_from_prefix(policy, "r", 65536, 0.0, pool, cached_tokens=61440,
                           holders=(5, 4), source="doc")
    plan = opt.plan.validate(8)
    assert opt.decision == "extend"
    assert (plan.cached_tokens, plan.cached_instances, plan.cached_source) == (61440, (5, 4),
                                                                              "doc")
    assert plan.chunks[0].start == 61440 and plan.chunks[0].instances[:2] == (5, 4)
    # The TTFT is Eq. 1 of the chunks with the prefix as history, from an idle pool.
    t = 0.0
    for c in plan.chunks:
        t = max(t, c.expected_start) + prof.predict(c.sp_size, c.history_tokens, c.tokens)
        assert c.expected_end == pytest.approx(t)
    assert plan.ttft_estimate == pytest.approx(t)
    # ... and far below computing the whole prompt.
    assert opt.other_ttft == policy.plan("r", 65536, 0.0, pool).ttft_estimate
    assert plan.ttft_estimate < opt.other_ttft / 3


def test_busy_holders_make_the_plan_recompute(prof):
    policy = make_policy("tetris", prof)
    pool = PoolState.uniform(8, 4, [50.0, 50.0] + [0.0] * 6)
    opt = plan_from_prefix(policy, "r", 8192, 0.0, pool, cached_tokens=4096,
                           holders=(0, 1), source="doc")
    assert opt.decision == "recompute" and opt.plan.cached_tokens == 0
    assert opt.plan == policy.plan("r", 8192, 0.0, pool)
    assert opt.other_ttft > 50.0


def test_a_full_hit_still_computes_the_last_token(prof):
    policy = make_policy("tetris-single-chunk", prof)
    pool = PoolState.uniform(4, 4)
    opt = plan_from_prefix(policy, "r", 4096, 0.0, pool, cached_tokens=4096,
                           holders=(2,), source="s")
    plan = opt.plan.validate(4)
    assert plan.cached_tokens == 4095 and plan.chunks == (
        Chunk(4095, 4096, (2,), 0.0, prof.predict(1, 4095, 1)),)


def test_a_whole_pool_of_holders_has_nobody_to_add(prof):
    policy = make_policy("tetris", prof)
    pool = PoolState.uniform(2, 2, [1.0, 0.5])
    opt = plan_from_prefix(policy, "r", 20000, 0.0, pool, cached_tokens=16000,
                           holders=(1, 0), source="s")
    assert opt.decision == "extend"
    (c,) = opt.plan.chunks
    assert c.instances == (1, 0) and c.expected_start == 1.0
    assert c.expected_end == pytest.approx(1.0 + prof.predict(2, 16000, 4000))


def test_validate_holds_the_cached_prefix_to_the_plan_invariants():
    ok = PrefillPlan("r", 100, (Chunk(64, 100, (3, 1)),), cached_tokens=64,
                     cached_instances=(3,), cached_source="s")
    ok.validate(4)
    with pytest.raises(PlanError):   # the first group must start with the holders
        PrefillPlan("r", 100, (Chunk(64, 100, (1, 3)),), cached_tokens=64,
                    cached_instances=(3,)).validate(4)
    with pytest.raises(PlanError):   # cached tokens without holders
        PrefillPlan("r", 100, (Chunk(64, 100, (1,)),), cached_tokens=64).validate(4)
    with pytest.raises(PlanError):   # nothing left to compute
        PrefillPlan("r", 100, (Chunk(0, 100, (1,)),), cached_tokens=100,
                    cached_instances=(1,)).validate(4)


def _plane(prof, index):
    queue = PrefillQueue([0, 0, 1, 1])
    router = DecodeRouter([1 << 20, 1 << 20])
    return ControlPlane(make_policy("tetris", prof), queue, router, improvement_rate=0.3,
                        prefix_index=index)


def test_control_plane_plans_from_the_index_and_frees_what_it_holds(prof):
    index = PrefixIndex(block_tokens=512, capacity_blocks=64)
    cp = _plane(prof, index)
    doc = index.hashes(list(range(16384)))        # 32 blocks of a document
    first = cp.admit("q1", 16384 + 300, 100, 0.0, block_hashes=doc)
    assert first.plan.cached_tokens == 0
    cp.prefill_done("q1", first.plan.ttft_estimate)
    assert cp.prefix_cached("q1") == 32
    second = cp.admit("q2", 16384 + 200, 100, 10.0, block_hashes=doc)
    assert second.plan.cached_tokens == 16384
    assert second.plan.cached_instances == first.plan.instances
    assert second.plan.cached_source == "q1"
    assert cp.held()["prefix_refs"] == 1
    cp.prefill_done("q2", second.plan.ttft_estimate + 10.0)
    assert cp.prefix_cached("q2") == 32
    assert cp.prefix_released() == ["q1"]     # q2's KV holds the document now
    cp.finished("q2", 20.0)
    cp.finished("q1", 20.0)
    assert cp.held() == {"queue_bookings": 0, "virtual_usage": 0, "virtual_requests": 0,
                         "prefix_refs": 0}
    assert index.clear() == ["q2"]
    index.check()
    # A run is readable from its commit; one that ends without a prefill is forgotten.
    cp.admit("q3", 16384 + 200, 100, 30.0, block_hashes=doc)
    assert index.match(doc).source == "q3"
    cp.finished("q3", 31.0)
    assert len(index) == 0 and cp.prefix_released() == ["q3"]
    index.check()


def test_a_run_may_plan_from_a_prefix_still_being_prefilled(prof):
    """Indexed at commit: the second question plans from the first before its prefill ended,
    on its instances, starting when they are done (Eq. 2)."""
    index = PrefixIndex(block_tokens=512, capacity_blocks=256)
    cp = _plane(prof, index)
    doc = index.hashes(list(range(65536)))
    first = cp.admit("q1", 65536 + 100, 100, 0.0, block_hashes=doc).plan
    second = cp.admit("q2", 65536 + 300, 100, 0.1, block_hashes=doc).plan
    assert second.cached_source == "q1" and second.cached_tokens == 65536
    assert second.chunks[0].expected_start >= first.chunks[-1].expected_end


def test_without_hashes_the_plane_plans_as_before(prof):
    cp = _plane(prof, PrefixIndex(512, 8))
    plain = _plane(prof, None)
    a = cp.admit("r", 9000, 10, 0.0)
    b = plain.admit("r", 9000, 10, 0.0)
    assert a == b


def test_a_recompute_faster_by_less_than_theta_keeps_the_cache(prof):
    """θ = 0.3 keeps the cached suffix on one instance (SP 2 gains too little for 408 tokens)
    while the whole 680-token prompt goes to SP 2: that is sooner, but by less than θ of the
    cached plan's TTFT, and it would compute the prefix again."""
    policy = make_policy("tetris", prof, improvement_rate=0.3)
    pool = PoolState.uniform(4, 2)
    opt = plan_from_prefix(policy, "r", 680, 0.0, pool, cached_tokens=272, holders=(0,),
                           source="s")
    assert opt.decision == "extend" and opt.plan.chunks[0].instances == (0,)
    assert opt.other_ttft < opt.plan.ttft_estimate < opt.other_ttft / (1 - 0.3)
