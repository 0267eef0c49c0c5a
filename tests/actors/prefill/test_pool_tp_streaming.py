"""KV streaming from TP-2 prefill instances (actors/prefill/tp.py) to the two TP ranks of a
decode instance through NIXL (UCX): each prefill TP rank streams its own KV head to the
receiver that holds that head, under its instance's sender id; what arrives is the single
instance's KV, and nothing is left held on either side."""

from __future__ import annotations

import msgspec
import pytest
import ray
import torch
from prefill_reference import reference
from test_prefill_streaming import (
    HKV,
    MODEL,
    TP,
    TRANSFER,
    RankReceiverActor,
    _nothing_held,
    _outcomes,
    _prompt,
)

from tetris.actors.prefill.messages import PrefillError
from tetris.config import load_deployment
from tetris.plan import Chunk, PrefillPlan
from tetris.transfer.backends import nixl_unavailable_reason
from tetris.transfer.states import RequestReady

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def setup(ray_session):
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from tetris.actors.prefill.pool import PrefillPool

    cfg = load_deployment("tiny-cpu.toml")
    dep = msgspec.structs.replace(cfg, model=MODEL, prefill=msgspec.structs.replace(
        cfg.prefill, num_instances=2, node_size=2, tp_size=2, kv_blocks_per_instance=320))
    pool = PrefillPool(dep, timeout_s=8.0)
    ranks = [RankReceiverActor.remote(r, TRANSFER) for r in range(TP)]
    infos = pool.enable_transfer(TRANSFER)
    assert {i: info.name for i, info in infos.items()} == {0: "prefill-0", 1: "prefill-1"}
    pool.connect_receivers({r: (ranks[r], ray.get(ranks[r].info.remote())) for r in range(TP)})
    ray.get([rk.connect.remote(dict(enumerate(pool.workers))) for rk in ranks])
    yield pool, ranks
    pool.shutdown()
    for rk in ranks:
        ray.kill(rk)


@pytest.fixture(scope="module")
def model():
    from tetris.model.loader import load_model

    return load_model(MODEL)[0]


def test_each_tp_rank_streams_its_head_to_its_receiver(setup, model):
    pool, ranks = setup
    n, rid = 150, "tp-stream"
    ids = _prompt(n, 3)
    plan = PrefillPlan(rid, n, (Chunk(0, 50, (0,)), Chunk(50, n, (0, 1))))
    assert all(ray.get([rk.reserve.remote(rid, n) for rk in ranks]))
    res = pool.run(plan, ids, kv_receivers=tuple(range(TP)))
    assert res.balance_moved_tokens > 0   # moved history is not streamed twice
    assert res.first_token_streamed
    ready = _outcomes(ranks, rid)
    assert all(isinstance(e, RequestReady) for e in ready), ready
    _logits, ref_k, ref_v = reference(model, ids)
    for r, (rk, e) in enumerate(zip(ranks, ready)):
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
    _nothing_held(pool, ranks)


def test_receivers_not_a_multiple_of_the_tp_size_are_refused(setup):
    pool, ranks = setup
    plan = PrefillPlan("tp-stream-odd", 40, (Chunk(0, 40, (0, 1)),))
    with pytest.raises(PrefillError, match="must be a multiple of 2"):
        pool.run(plan, _prompt(40, 4), kv_receivers=(0,))
    _nothing_held(pool, ranks)
