"""CDSP prefill on a pool of 8 Ray actors over 2 nodes (gloo), against single-instance prefill.

One pool serves the whole module (actors start slowly on two shared cores). The reference is the
engine's prefill math: ``model.forward`` with plain causal attention on one instance.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefill_reference import prompt, reference

from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.messages import PrefillError, PrefillPlanOutdated, PrefillWorkerLost
from tetris.actors.prefill.zigzag import ranges_to_list
from tetris.config import load_deployment
from tetris.errors import InstanceLost, InstanceReplacing
from tetris.plan import Chunk, PlanError, PrefillPlan

pytestmark = pytest.mark.ray

POOL_SIZE, NODE_SIZE = 8, 4


@pytest.fixture(scope="module")
def deployment():
    import msgspec

    cfg = load_deployment("tiny-cpu.toml")
    # 640 blocks x 16 = 10240 token slots per worker: the 8k case fits, a 12k chunk does not.
    return msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, kv_blocks_per_instance=640))


@pytest.fixture(scope="module")
def pool(ray_session, deployment):
    from tetris.actors.prefill.pool import PrefillPool

    p = PrefillPool(deployment, num_instances=POOL_SIZE, node_size=NODE_SIZE, timeout_s=8.0)
    yield p
    p.shutdown()


def _spread_bound(plan, balance) -> int:
    """Largest difference of final KV counts: zigzag shares of one chunk differ by at most 2, and
    balancing evens the history only in a chunk that grows the group (chunks on an unchanged
    group add their differences up)."""
    if balance == "off":
        return 2 + 2 * plan.chunks[-1].start
    grew = [k for k in range(1, len(plan.chunks))
            if len(plan.chunks[k].instances) > len(plan.chunks[k - 1].instances)]
    return 2 * (len(plan.chunks) - (grew[-1] if grew else 0))


def _check_against_reference(pool, model, plan, ids, **kw):
    res = pool.run(plan, ids, return_logits=True, **kw)
    ref_logits, ref_k, ref_v = reference(model, ids)
    got = torch.tensor(res.logits)
    rel = ((got - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < 1e-4, f"last-token logits differ by {rel:.2e} relative"
    assert res.first_token == int(ref_logits.argmax())
    # The union of the workers' KV is exactly the single-instance KV, every layer and position.
    parts = pool.export_kv(plan.request_id)
    assert sorted(parts) == sorted(plan.instances)
    pos = torch.cat([p for p, _, _ in parts.values()])
    assert sorted(pos.tolist()) == list(range(len(ids)))
    k = torch.cat([k for _, k, _ in parts.values()], dim=1)
    v = torch.cat([v for _, _, v in parts.values()], dim=1)
    torch.testing.assert_close(k, ref_k[:, pos], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(v, ref_v[:, pos], rtol=1e-4, atol=1e-5)
    # Each worker holds what the plan's layout says, and the final group's shares are even.
    layout = dict(res.kv_layout)
    for i, (p, _, _) in parts.items():
        assert p.tolist() == ranges_to_list(layout[i])
    sizes = [len(ranges_to_list(r)) for r in layout.values()]
    assert max(sizes) - min(sizes) <= _spread_bound(plan, kw.get("balance"))
    pool.release(plan.request_id)
    assert all(not held for held in pool.held_requests().values())
    return res


@pytest.mark.parametrize("n,spec,balance", [
    (1024, "1024x1", "overlap"),
    (1500, "300x1,500x2,restx4", "overlap"),
    (1500, "300x1,500x2,restx4", "blocking"),
    (1500, "300x1,500x2,restx4", "off"),
    (1999, "333x2,777x3,restx8", "overlap"),     # odd lengths, SP 3, both nodes
])
def test_forced_plans_match_single_instance(pool, model, n, spec, balance):
    plan = forced_plan(f"fp-{spec}-{balance}", n, spec, pool.node_of)
    res = _check_against_reference(pool, model, plan, prompt(n, n), balance=balance)
    if balance == "off":
        assert res.balance_moved_tokens == 0
    elif len(plan.chunks) > 1:
        assert res.balance_moved_tokens > 0


def test_8k_prompt_four_chunks_two_nodes(pool, model):
    n = 8192
    plan = forced_plan("long-8k", n, "1500x1,2500x2,2000x4,restx8", pool.node_of)
    assert {pool.node_of[i] for i in plan.instances} == {0, 1}
    _check_against_reference(pool, model, plan, prompt(n, 8))


@st.composite
def random_plans(draw):
    n = draw(st.integers(64, 700))
    num_chunks = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=num_chunks - 1,
                                max_size=num_chunks - 1, unique=True)))
    sizes = sorted(draw(st.lists(st.integers(1, POOL_SIZE), min_size=num_chunks,
                                 max_size=num_chunks)))
    order = draw(st.permutations(list(range(POOL_SIZE))))
    bounds = [0, *cuts, n]
    chunks = tuple(Chunk(start=bounds[k], end=bounds[k + 1], instances=tuple(order[:sizes[k]]))
                   for k in range(num_chunks))
    return PrefillPlan(request_id=f"hyp-{draw(st.integers(0, 10**9))}", prompt_tokens=n,
                       chunks=chunks)


@given(plan=random_plans(), seed=st.integers(0, 1000))
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_plans_match_single_instance(pool, model, plan, seed):
    _check_against_reference(pool, model, plan, prompt(plan.prompt_tokens, seed))


@pytest.mark.parametrize("chunks,msg", [
    (((0, 50, (0,)), (60, 100, (0, 1))), "should start at"),
    (((0, 50, (0, 1)), (50, 100, (0,))), "groups only grow"),
    (((0, 100, (3, 9)),), "outside"),
])
def test_broken_plans_rejected_before_running(pool, chunks, msg):
    plan = PrefillPlan("broken", 100, tuple(Chunk(s, e, g) for s, e, g in chunks))
    with pytest.raises(PlanError, match=msg):
        pool.run(plan, prompt(100, 0))
    with pytest.raises(PlanError, match="prompt has 99"):
        pool.run(forced_plan("short", 100, "100x2", pool.node_of), prompt(99, 0))
    assert all(not held for held in pool.held_requests().values())


def test_failed_worker_frees_request_and_pool_keeps_serving(pool, model):
    plan = forced_plan("doomed", 600, "200x2,restx4", pool.node_of)
    victim = plan.chunks[1].instances[3]
    pool.workers[victim].set_fault.remote("doomed", 1, 2)
    with pytest.raises(PrefillError, match=rf"chunk 1 failed on prefill instance {victim} .*"
                                           r"FaultInjected") as e:
        pool.run(plan, prompt(600, 1))
    assert not isinstance(e.value, InstanceLost)      # the worker lives: no retry elsewhere
    assert all(not held for held in pool.held_requests().values())
    # The same instances serve the next request correctly.
    _check_against_reference(pool, model, forced_plan("after", 700, "300x2,restx4",
                                                        pool.node_of), prompt(700, 2))


def test_a_killed_worker_is_replaced_and_its_instance_serves_again(pool, model):
    """A worker that died is found by the first call it gets (``prepare``): the request fails
    at once and frees everything while the worker is replaced in the background (the pool
    reports the instance as being replaced); a new plan on its instance is refused at commit,
    or, committed to wait, waits for the replacement and the world formed again, then matches
    the single-instance reference."""
    import ray

    plan = forced_plan("killed", 600, "200x2,restx4", pool.node_of)
    victim = plan.chunks[0].instances[1]
    old, replaced = pool.workers[victim], pool.replacements
    blind = forced_plan("planned-before", 600, "200x2,restx4", pool.node_of)
    pool.commit(plan)
    pool.commit(blind)      # planned before anyone knew: on the victim, behind "killed"
    ray.kill(old)
    time.sleep(0.5)
    # freeing other requests' KV must not fail on the dead worker (it holds nothing now)
    pool.release("another-request")
    pool.abort("another-request")
    assert pool.held_requests()[victim] == []
    t0 = time.monotonic()
    with pytest.raises(PrefillWorkerLost, match=rf"prefill instance {victim}"):
        pool.run(plan, prompt(600, 4))   # lost, not failed: the dispatcher plans it again
    lost_after = time.monotonic() - t0
    busy = pool.busy_for()
    assert busy[victim] == float("inf") and pool.replacements == replaced   # still starting
    # a plan made before the worker was found dead does not hold its members' turns for the
    # replacement: it is lost at once and the dispatcher plans it again around the instance
    t1 = time.monotonic()
    with pytest.raises(PrefillPlanOutdated, match=rf"prefill instance {victim} .*being replaced"):
        pool.run(blind, prompt(600, 4))
    assert time.monotonic() - t1 < 2.0 and pool.replacements == replaced
    assert all(b < float("inf") for i, b in enumerate(busy) if i != victim)
    assert all(not held for i, held in pool.held_requests().items() if i != victim)
    # a new plan on the instance is refused at commit (its planner plans again around it),
    # unless its planner insists: then it waits for the replacement and runs on it
    after = forced_plan("after-kill", 600, "200x2,restx4", pool.node_of)
    commits = pool._tickets.commits()
    with pytest.raises(InstanceReplacing, match=rf"instances \[{victim}\].*being replaced") as e:
        pool.commit(after)
    assert e.value.instances == (victim,) and pool._tickets.commits() == commits
    pool.commit(after, wait_replacing=True)
    _check_against_reference(pool, model, after, prompt(600, 5))
    assert pool.workers[victim] is not old and pool.replacements == replaced + 1
    assert pool.busy_for()[victim] < float("inf")
    assert all(not held for held in pool.held_requests().values())
    assert lost_after < 5.0, f"the lost request waited {lost_after:.1f} s"


def test_out_of_kv_blocks_fails_in_prepare_and_frees_earlier_chunks(pool):
    plan = forced_plan("huge", 12100, "100x1,restx1", pool.node_of)
    with pytest.raises(PrefillError, match="chunk 1 failed .* during prepare: KVCapacityError"):
        pool.run(plan, prompt(12100, 3))
    assert all(not held for held in pool.held_requests().values())


def test_concurrent_requests_on_disjoint_groups(pool, model):
    plans = [
        PrefillPlan("left", 500, (Chunk(0, 200, (0, 1)), Chunk(200, 500, (0, 1, 2, 3)))),
        PrefillPlan("right", 400, (Chunk(0, 150, (4,)), Chunk(150, 400, (4, 5, 6, 7)))),
    ]
    prompts = [prompt(500, 5), prompt(400, 6)]
    results: dict[str, object] = {}

    def go(plan, ids):
        results[plan.request_id] = pool.run(plan, ids, return_logits=True)

    threads = [threading.Thread(target=go, args=a) for a in zip(plans, prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for plan, ids in zip(plans, prompts):
        ref_logits, _, _ = reference(model, ids)
        got = torch.tensor(results[plan.request_id].logits)
        assert ((got - ref_logits).abs().max() / ref_logits.abs().max()).item() < 1e-4
        pool.release(plan.request_id)


def test_chunks_shorter_than_the_ring(pool, model):
    # 3 tokens on 4 members and 1 token on 8: members without tokens still relay KV.
    plan = PrefillPlan("tiny-chunks", 12, (Chunk(0, 3, (0, 1, 2, 3)), Chunk(3, 11, (0, 1, 2, 3)),
                                           Chunk(11, 12, tuple(range(8)))))
    _check_against_reference(pool, model, plan, prompt(12, 9))


def _logged_run(pool, log, lock, plan, ids, results):
    def mark(what):
        def cb(k, *ok):
            with lock:
                log.append((plan.request_id, k, what) + tuple(ok))
        return cb

    try:
        results[plan.request_id] = pool.run(plan, ids, return_logits=True,
                                            on_chunk_start=mark("start"), on_chunk_end=mark("end"))
    except Exception as e:  # noqa: BLE001 - the test reads it
        results[plan.request_id] = e


def test_overlapping_plans_from_two_threads_run_in_commit_order(pool, model):
    # Both plans use instances 0-3 in their last chunk, entering in opposite orders; without a
    # common order each ring would wait for a member busy with the other one.
    first = PrefillPlan("first", 300, (Chunk(0, 100, (0, 1)), Chunk(100, 300, (0, 1, 2, 3))))
    second = PrefillPlan("second", 260, (Chunk(0, 90, (2, 3)), Chunk(90, 260, (2, 3, 0, 1))))
    prompts = {"first": prompt(300, 11), "second": prompt(260, 12)}
    pool.commit(first)
    pool.commit(second)
    log: list = []
    lock = threading.Lock()
    results: dict = {}
    threads = {p.request_id: threading.Thread(target=_logged_run,
                                              args=(pool, log, lock, p, prompts[p.request_id], results))
               for p in (first, second)}
    threads["second"].start()                       # the later-committed plan asks first
    deadline = time.monotonic() + 10
    while ("second", 0) not in pool._tickets.pending().get(2, []) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert log == []                                # it waits for "first", which has not come
    threads["first"].start()
    for t in threads.values():
        t.join(timeout=120)
    assert log == [("first", 0, "start"), ("first", 0, "end", True), ("first", 1, "start"),
                   ("first", 1, "end", True), ("second", 0, "start"), ("second", 0, "end", True),
                   ("second", 1, "start"), ("second", 1, "end", True)]
    for rid, ids in prompts.items():
        ref_logits, _, _ = reference(model, ids)
        got = torch.tensor(results[rid].logits)
        assert ((got - ref_logits).abs().max() / ref_logits.abs().max()).item() < 1e-4
        pool.release(rid)
    assert pool._tickets.pending() == {}


def test_aborted_committed_plan_does_not_block_later_plans(pool):
    doomed = PrefillPlan("never-run", 200, (Chunk(0, 200, (4, 5)),))
    later = PrefillPlan("later", 150, (Chunk(0, 50, (5,)), Chunk(50, 150, (5, 4))))
    pool.commit(doomed)
    pool.commit(later)
    with pytest.raises(PlanError, match="already committed"):
        pool.commit(later)
    pool.abort("never-run")
    res = pool.run(later, prompt(150, 13))     # would wait for "never-run" forever otherwise
    assert res.first_token is not None
    with pytest.raises(PrefillError, match="aborted before its prefill started"):
        pool.run(doomed, prompt(200, 14))
    pool.release("later")
    assert pool._tickets.pending() == {}
    assert all(not held for held in pool.held_requests().values())


def test_node_map_matches_the_virtual_nodes(pool):
    assert pool.node_map() == [i // NODE_SIZE for i in range(POOL_SIZE)]


class _Counted:
    """A worker handle that notes each call made through it (instance, method), then makes it."""

    def __init__(self, handle, instance: int, calls: list) -> None:
        self._handle, self._instance, self._calls = handle, instance, calls

    def __getattr__(self, method: str):
        real = getattr(self._handle, method)
        outer = self

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                outer._calls.append((outer._instance, method))
                return real.remote(*args, **kwargs)

        return _Method()


def test_release_and_abort_reach_only_the_plans_members(pool):
    plan = forced_plan("members", 400, "100x1,restx2", pool.node_of)
    members = sorted(plan.instances)
    assert 0 < len(members) < POOL_SIZE
    pool.run(plan, prompt(400, 15))
    held = pool.held_requests()
    assert sorted(i for i, h in held.items() if "members" in h) == members
    real, calls = pool.worlds.workers, []
    pool.worlds.workers = [_Counted(w, i, calls) for i, w in enumerate(real)]
    try:
        pool.release("members")
        assert calls == [(i, "release") for i in members]
        calls.clear()
        pool.release("members")      # released already: no worker holds it any more
        pool.abort("never-committed")
        assert calls == []
        doomed = PrefillPlan("aborted", 200, (Chunk(0, 200, (4, 5)),))
        pool.commit(doomed)
        pool.abort("aborted")
        assert calls == [(4, "abort"), (5, "abort")]
    finally:
        pool.worlds.workers = real
    assert all(not held for held in pool.held_requests().values())
    assert pool._tickets.pending() == {}
