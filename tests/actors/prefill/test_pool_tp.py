"""Prefill instances with TP 2 (actors/prefill/tp.py): a pool of 2 instances, 4 worker actors
(gloo), against single-instance prefill of the unsharded model.

Each TP rank holds one of the small model's two KV heads; the ring and the cache balancing of
head slice t run between the TP ranks t of the chunk's members. The first token, the
last-token logits (within the project's fp32 bound and ``tests/exactness.py``'s logprob bound)
and every layer's KV, gathered over the ranks' head slices, equal the single instance's.
Streaming (NIXL over UCX) to the two TP ranks of a decode instance: each prefill TP rank
streams its own head to the receiver holding that head, under its instance's sender id.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from exactness import assert_logprob_close, logprobs_of_logits
from prefill_reference import reference
from test_prefill_streaming import (
    HKV,
    MODEL,
    TP,
    TRANSFER,
    RankReceiverActor,
    _nothing_held,
    _outcomes,
)
from test_prefill_streaming import _prompt as prompt

from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.messages import PrefillError
from tetris.actors.prefill.zigzag import ranges_to_list
from tetris.config import load_deployment
from tetris.plan import Chunk, PrefillPlan
from tetris.transfer.backends import nixl_unavailable_reason
from tetris.transfer.states import RequestReady

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def deployment():
    """The streaming tests' small model (2 KV heads, 2 layers), TP-2 prefill instances."""
    cfg = load_deployment("tiny-cpu.toml")   # decode TP 2: two receivers per decode instance
    return msgspec.structs.replace(cfg, model=MODEL, prefill=msgspec.structs.replace(
        cfg.prefill, tp_size=2, kv_blocks_per_instance=320))


@pytest.fixture(scope="module")
def pool(ray_session, deployment):
    from tetris.actors.prefill.pool import PrefillPool

    p = PrefillPool(deployment, num_instances=2, node_size=1, timeout_s=8.0)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def receivers(pool):
    """The two TP ranks of a decode instance, the pool's send side connected to them."""
    import ray

    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    ranks = [RankReceiverActor.remote(r, TRANSFER) for r in range(TP)]
    infos = pool.enable_transfer(TRANSFER)
    assert {i: info.name for i, info in infos.items()} == {0: "prefill-0", 1: "prefill-1"}
    pool.connect_receivers({r: (ranks[r], ray.get(ranks[r].info.remote())) for r in range(TP)})
    ray.get([rk.connect.remote(dict(enumerate(pool.workers))) for rk in ranks])
    yield ranks
    for rk in ranks:
        ray.kill(rk)


def _check(pool, model, plan, ids, balance="overlap"):
    res = pool.run(plan, ids, return_logits=True, balance=balance)
    ref_logits, ref_k, ref_v = reference(model, ids)
    got = torch.tensor(res.logits)
    rel = ((got - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < 1e-4, f"last-token logits differ by {rel:.2e} relative"
    assert res.first_token == int(ref_logits.argmax())
    token = res.first_token
    assert_logprob_close(logprobs_of_logits([got], [token])[0],
                         logprobs_of_logits([ref_logits], [token])[0], plan.request_id)
    # Every instance's KV, its TP ranks' head slices side by side, is the single instance's.
    parts = pool.export_kv(plan.request_id)
    assert sorted(parts) == sorted(plan.instances)
    pos = torch.cat([p for p, _, _ in parts.values()])
    assert sorted(pos.tolist()) == list(range(len(ids)))
    k = torch.cat([k for _, k, _ in parts.values()], dim=1)
    v = torch.cat([v for _, _, v in parts.values()], dim=1)
    torch.testing.assert_close(k, ref_k[:, pos], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(v, ref_v[:, pos], rtol=1e-4, atol=1e-5)
    layout = dict(res.kv_layout)
    for i, (p, _, _) in parts.items():
        assert p.tolist() == ranges_to_list(layout[i])
    pool.release(plan.request_id)
    assert all(not held for held in pool.held_requests().values())
    return res


def test_each_instance_is_two_ranks_with_one_kv_head_each(pool):
    import ray

    assert [ray.get(w.kv_heads.remote()) for w in pool.workers] == [[1, 1], [1, 1]]


def test_each_tp_rank_streams_its_head_to_its_receiver(pool, receivers, model):
    import ray

    n, rid = 150, "tp-stream"
    ids = prompt(n, 3)
    plan = PrefillPlan(rid, n, (Chunk(0, 50, (0,)), Chunk(50, n, (0, 1))))
    assert all(ray.get([rk.reserve.remote(rid, n) for rk in receivers]))
    res = pool.run(plan, ids, kv_receivers=tuple(range(TP)))
    assert res.balance_moved_tokens > 0   # moved history is not streamed twice
    assert res.first_token_streamed
    ready = _outcomes(receivers, rid)
    assert all(isinstance(e, RequestReady) for e in ready), ready
    _logits, ref_k, ref_v = reference(model, ids)
    for r, (rk, e) in enumerate(zip(receivers, ready)):
        got = ray.get(rk.read_back.remote(e.block_table, n))
        heads = slice(r * HKV // TP, (r + 1) * HKV // TP)
        torch.testing.assert_close(got[:, :, 0], ref_k[:, :, heads], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[:, :, 1], ref_v[:, :, heads], rtol=1e-4, atol=1e-5)
        ray.get(rk.give_back.remote(e.block_table))
    # one shard per (chunk, member with tokens, receiver), as with TP 1: each receiver's from
    # the one TP rank holding its head
    states = pool.transfer_state(rid)
    assert {i: st["shards"] for i, st in states.items()} == {0: 4, 1: 2}
    assert all(not st["failed"] for st in states.values())
    pool.release(rid)
    _nothing_held(pool, receivers)


def test_a_prefix_moved_between_tp_instances_streams_each_head_to_its_receiver(pool, receivers,
                                                                             model):
    """A cached prefix on instance 0 moved to instance 1 (``cached_moved``, prefix_move.py):
    each TP rank of 0 exports its head, each TP rank of 1 keeps its own and streams it to the
    receiver holding that head; logits, KV and the streamed KV equal single-instance prefill."""
    import ray

    n, cached, rid = 200, 128, "tp-moved"
    ids = prompt(n, 8)
    source = PrefillPlan("tp-moved-src", 150, (Chunk(0, 150, (0,)),))
    pool.run(source, ids[:150])
    plan = PrefillPlan(rid, n, (Chunk(cached, n, (1,)),), cached_tokens=cached,
                       cached_instances=(0,), cached_source=source.request_id, cached_moved=True)
    assert all(ray.get([rk.reserve.remote(rid, n) for rk in receivers]))
    res = pool.run(plan, ids, return_logits=True, kv_receivers=tuple(range(TP)))
    ref_logits, ref_k, ref_v = reference(model, ids)
    got = torch.tensor(res.logits)
    assert ((got - ref_logits).abs().max() / ref_logits.abs().max()).item() < 1e-4
    assert res.first_token == int(ref_logits.argmax())
    parts = pool.export_kv(rid)
    assert sorted(parts) == [1] and parts[1][0].tolist() == list(range(n))
    torch.testing.assert_close(parts[1][1], ref_k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parts[1][2], ref_v, rtol=1e-4, atol=1e-5)
    ready = _outcomes(receivers, rid)
    assert all(isinstance(e, RequestReady) for e in ready), ready
    for r, (rk, e) in enumerate(zip(receivers, ready)):
        back = ray.get(rk.read_back.remote(e.block_table, n))
        heads = slice(r * HKV // TP, (r + 1) * HKV // TP)
        torch.testing.assert_close(back[:, :, 0], ref_k[:, :, heads], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(back[:, :, 1], ref_v[:, :, heads], rtol=1e-4, atol=1e-5)
        ray.get(rk.give_back.remote(e.block_table))
    for r in (rid, source.request_id):
        pool.release(r)
    _nothing_held(pool, receivers)


def test_receivers_not_a_multiple_of_the_tp_size_are_refused(pool, receivers):
    plan = PrefillPlan("tp-stream-odd", 40, (Chunk(0, 40, (0, 1)),))
    with pytest.raises(PrefillError, match="must be a multiple of 2"):
        pool.run(plan, prompt(40, 4), kv_receivers=(0,))
    _nothing_held(pool, receivers)


@pytest.mark.parametrize("n,spec,balance", [
    (600, "restx2", "overlap"),                  # one chunk, a ring per head slice
    (900, "300x1,restx2", "overlap"),            # history on one instance, balanced to two
    (900, "300x1,restx2", "off"),                # the ring reads history where it was made
    (1100, "200x1,300x1,restx2", "blocking"),    # two chunks on one instance, then two
    # SP-TP per head slice, its rows summed over each instance's TP ranks (sptp.py), with
    # history, beside a2a and ring chunks
    (900, "200x1,300x2:sptp,200x2:a2a,restx2", "overlap"),
])
def test_forced_plans_match_single_instance(pool, model, n, spec, balance):
    plan = forced_plan(f"tp-{spec}-{balance}", n, spec, pool.node_of)
    res = _check(pool, model, plan, prompt(n, n), balance)
    if balance == "off":
        assert res.balance_moved_tokens == 0
    elif len(plan.chunks[-1].instances) > len(plan.chunks[0].instances):
        assert res.balance_moved_tokens > 0


def test_a_dead_tp_rank_loses_its_instance_and_the_replacement_serves(pool, model):
    """Killing TP rank 1 of instance 1 loses the instance: the pool's probe finds it dead
    (its leader ends itself), replaces it with a new TP group (its send side on again), and
    the next plan on both instances matches the single instance again."""
    import ray

    victim = 1
    follower, = ray.get(pool.workers[victim].tp_followers.remote())
    before = pool.replacements
    ray.kill(follower)
    assert pool.heal(timeout_s=30.0) == [victim]
    assert pool.replacements == before + 1
    assert ray.get(pool.workers[victim].kv_heads.remote()) == [1, 1]
    plan = forced_plan("tp-after-loss", 700, "300x1,restx2", pool.node_of)
    _check(pool, model, plan, prompt(700, 7))


def test_a_chunk_failing_inside_a_tp_instance_loses_its_members_which_are_replaced(pool, model):
    """A failure inside a chunk may leave an instance's ranks at different all-reduces, so every
    TP member of the chunk is lost at once (none waits out a timeout); the pool replaces them
    and the next plan on both matches the single instance."""
    import ray

    from tetris.actors.prefill.messages import PrefillWorkerLost

    plan = forced_plan("tp-fault", 600, "200x1,restx2", pool.node_of)
    victim = plan.chunks[1].instances[-1]
    ray.get(pool.workers[victim].set_fault.remote("tp-fault", 1, 1))
    before = pool.replacements
    with pytest.raises(PrefillWorkerLost, match="chunk 1 failed"):
        pool.run(plan, prompt(600, 5))
    pool.heal(timeout_s=30.0)   # both found dead: waits for the replacements under way
    assert pool.replacements == before + 2
    _check(pool, model, forced_plan("tp-after-fault", 700, "300x1,restx2", pool.node_of),
           prompt(700, 6))
