"""Prefix caching's third placement on a pool of 4 Ray prefill workers over 2 nodes (gloo): a
cached prefix's KV moved from its holders to a first group without them
(``PrefillPlan.cached_moved``, actors/prefill/prefix_move.py) gives the same first token,
last-token logits and KV as single-instance prefill of the tiny model, leaves the source
untouched, and leaks nothing when the prefix is not whole."""

from __future__ import annotations

import pytest
import torch
from prefill_reference import prompt, reference
from tetris.actors.prefill.layout import forced_plan

from tetris.plan import Chunk, PrefillPlan

pytestmark = pytest.mark.ray


def _assert_same_as_reference(pool, model, res, request_id, ids):
    ref_logits, ref_k, ref_v = reference(model, ids)
    got = torch.tensor(res.logits)
    rel = ((got - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < 1e-4, f"last-token logits differ by {rel:.2e} relative"
    assert res.first_token == int(ref_logits.argmax())
    parts = pool.export_kv(request_id)
    pos = torch.cat([p for p, _, _ in parts.values()])
    assert sorted(pos.tolist()) == list(range(len(ids)))   # the whole prompt, once
    torch.testing.assert_close(torch.cat([k for _, k, _ in parts.values()], dim=1),
                               ref_k[:, pos], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([v for _, _, v in parts.values()], dim=1),
                               ref_v[:, pos], rtol=1e-4, atol=1e-5)
    return parts


def _moved(request_id, ids, cached, source, groups, cuts=()):
    """A moved plan: chunks ``[cached, cuts..., len(ids))`` on ``groups``."""
    bounds = (cached, *cuts, len(ids))
    chunks = tuple(Chunk(a, b, g) for a, b, g in zip(bounds, bounds[1:], groups))
    return PrefillPlan(request_id, len(ids), chunks, cached_tokens=cached,
                       cached_instances=source.instances, cached_source=source.request_id,
                       cached_moved=True).validate(4)


@pytest.mark.parametrize("case,shared,extra,cached,groups,cuts", [
    # the prefix on {0, 1} moved to {2, 3}: one chunk, no balancing before it
    ("disjoint", 600, 90, 600, [(2, 3)], ()),
    # a hit that ends inside a block (16-token blocks), to one instance, then grown to two
    ("inside-block", 520, 100, 517, [(2,), (2, 3)], (560,)),
    # a group that shares one holder: it exports and imports at once
    ("overlap", 560, 70, 560, [(1, 2, 3)], ()),
])
def test_a_moved_prefix_equals_single_instance_prefill(pool, model, case, shared, extra,
                                                      cached, groups, cuts):
    src_ids = prompt(640, seed=31)
    ids = src_ids[:shared] + prompt(extra, seed=32)
    source = forced_plan(f"mv-{case}-src", len(src_ids), "300x1,restx2", pool.node_of)
    assert source.instances == (0, 1)   # the holders: the prefix sharded by a two-chunk ring
    pool.run(source, src_ids)
    before = pool.export_kv(source.request_id)
    plan = _moved(f"mv-{case}", ids, cached, source, groups, cuts)
    res = pool.run(plan, ids, return_logits=True)
    parts = _assert_same_as_reference(pool, model, res, plan.request_id, ids)
    # The prefix lies on G, spread evenly: the run holds nothing on a holder outside G.
    assert sorted(parts) == sorted(plan.instances)
    if len(groups) == 1:
        assert res.balance_moved_tokens == 0   # no balancing before chunk 0
        counts = [sum(int(p < cached) for p in parts[i][0].tolist()) for i in groups[0]]
        assert max(counts) - min(counts) <= 1 and sum(counts) == cached
    # Export is read-only: the source is as it was on its holders.
    after = pool.export_kv(source.request_id)
    assert sorted(after) == sorted(before) == [0, 1]
    for i in before:
        for a, b in zip(before[i], after[i]):
            assert torch.equal(a, b)
    for r in (source.request_id, plan.request_id):
        pool.release(r)
    assert not any(pool.held_requests().values())


def test_a_wrong_prefix_moved_is_caught(pool, model):
    """The check above fails when the moved KV is not the prompt's: a source whose document
    differs in one token (position 100) gives other logits and KV."""
    src_ids = prompt(500, seed=33)
    ids = src_ids[:480] + prompt(40, seed=34)
    wrong = list(src_ids)
    wrong[100] = (wrong[100] + 1) % 512
    source = forced_plan("mv-wrong-src", len(wrong), "restx2", pool.node_of)
    pool.run(source, wrong)
    plan = _moved("mv-wrong", ids, 480, source, [(2, 3)])
    res = pool.run(plan, ids, return_logits=True)
    with pytest.raises(AssertionError):
        _assert_same_as_reference(pool, model, res, plan.request_id, ids)
    for r in (source.request_id, plan.request_id):
        pool.release(r)
    assert not any(pool.held_requests().values())


@pytest.mark.parametrize("how", ["released", "one-holder-named"])
def test_a_prefix_not_whole_on_its_holders_moves_nothing(pool, how):
    from tetris.actors.prefill.prefix import PrefillPrefixMissing

    ids = prompt(400, seed=35)
    source = forced_plan(f"mv-gone-{how}-src", 400, "restx2", pool.node_of)
    pool.run(source, ids)
    if how == "released":
        pool.release(source.request_id)   # e.g. the index let it go
        holders = source.instances
    else:                                  # half of the prefix is on the other holder
        holders = source.instances[:1]
    plan = PrefillPlan(f"mv-gone-{how}", 400, (Chunk(384, 400, (2, 3)),), cached_tokens=384,
                       cached_instances=holders, cached_source=source.request_id,
                       cached_moved=True).validate(4)
    with pytest.raises(PrefillPrefixMissing) as err:
        pool.run(plan, ids)
    assert err.value.source == source.request_id
    held = pool.held_requests()
    assert not any(plan.request_id in reqs for reqs in held.values())
    pool.release(source.request_id)
    assert not any(pool.held_requests().values())


def test_a_failed_import_frees_the_group_and_the_pool_goes_on(pool, model):
    """Instance 3 fails importing its share at layer 2 (after instance 2 imported its own and
    3 wrote layers 0-1): the run fails, nothing of it is held anywhere, the source is
    untouched, and the same move then succeeds."""
    from tetris.actors.prefill.messages import PrefillError
    from tetris.actors.prefill.prefix import PREFIX_CHUNK

    src_ids = prompt(500, seed=36)
    ids = src_ids[:448] + prompt(60, seed=37)
    source = forced_plan("mv-fail-src", len(src_ids), "restx2", pool.node_of)
    pool.run(source, src_ids)
    before = pool.export_kv(source.request_id)
    import ray

    ray.get(pool.workers[3].set_fault.remote("mv-fail", PREFIX_CHUNK, 2))
    with pytest.raises(PrefillError, match="FaultInjected"):
        pool.run(_moved("mv-fail", ids, 448, source, [(2, 3)]), ids)
    held = pool.held_requests()
    assert not any("mv-fail" in reqs for reqs in held.values()), held
    after = pool.export_kv(source.request_id)
    assert all(torch.equal(a, b) for i in before for a, b in zip(before[i], after[i]))
    res = pool.run(_moved("mv-fail-2", ids, 448, source, [(2, 3)]), ids, return_logits=True)
    _assert_same_as_reference(pool, model, res, "mv-fail-2", ids)
    for r in (source.request_id, "mv-fail-2"):
        pool.release(r)
    assert not any(pool.held_requests().values())


def test_a_move_waits_for_its_source_still_running_on_the_holders(pool, model):
    """The source is committed first and the moved run (on other instances, so its own turn
    says nothing about the holders) is started before the source runs at all: the export
    waits until the source's chunks left the holders, and the run equals the reference."""
    import threading

    src_ids = prompt(640, seed=38)
    ids = src_ids[:600] + prompt(50, seed=39)
    source = forced_plan("mv-pending-src", len(src_ids), "300x1,restx2", pool.node_of)
    plan = _moved("mv-pending", ids, 600, source, [(2, 3)])
    pool.commit(source)
    pool.commit(plan)
    got = {}
    mover = threading.Thread(target=lambda: got.update(res=pool.run(plan, ids,
                                                                    return_logits=True)))
    mover.start()
    pool.run(source, src_ids)
    mover.join(timeout=120)
    assert not mover.is_alive() and "res" in got
    _assert_same_as_reference(pool, model, got["res"], plan.request_id, ids)
    for r in (source.request_id, plan.request_id):
        pool.release(r)
    assert not any(pool.held_requests().values())
