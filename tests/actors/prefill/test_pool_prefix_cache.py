"""Prefix caching on a pool of 4 Ray prefill workers over 2 nodes (gloo): a run from a cached
prefix computes only its suffix and equals, token and logits, the run without the cache and
single-instance prefill of the tiny model; the control plane's index decides what is kept.
A prefix moved to a first group without its holders (``cached_moved``,
actors/prefill/prefix_move.py) does too, leaves its source untouched and leaks nothing."""

from __future__ import annotations

import pytest
import torch
from prefill_reference import prompt, reference

from tetris.actors.prefill.layout import forced_plan
from tetris.control import ControlPlane, PrefillQueue
from tetris.control.prefix_index import PrefixIndex
from tetris.plan import Chunk, PrefillPlan
from tetris.scheduler.policies import policy_from_config

pytestmark = pytest.mark.ray

BLOCK = 16


def _same_as_reference(pool, model, res, request_id, ids):
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
    return got


@pytest.mark.parametrize("case,source_spec,shared,extra,spec,cached", [
    # the whole prompt cached but its last token (the first output's logits need it)
    ("full", "restx1", 640, 0, "restx1", 639),
    # the prompts share 520 tokens: the hit is 32 whole blocks, 8 shared tokens are recomputed
    ("inside-block", "restx2", 520, 150, "restx2", 512),
    # the prefix sharded over two instances by a two-chunk ring, extended to all four
    ("sharded", "200x1,restx2", 704, 200, "restx4", 704),
])
def test_a_run_from_a_cached_prefix_equals_the_run_without(pool, model, case, source_spec,
                                                          shared, extra, spec, cached):
    src_ids = prompt(max(shared, 640) if case != "inside-block" else 600, seed=1)
    ids = src_ids[:shared] + prompt(extra, seed=2)
    source = forced_plan(f"{case}-src", len(src_ids), source_spec, pool.node_of)
    pool.run(source, src_ids)
    holders = source.instances
    plain = forced_plan(f"{case}-plain", len(ids), spec, pool.node_of)
    base = pool.run(plain, ids, return_logits=True)
    grown = forced_plan("g", len(ids), spec, pool.node_of).chunks[-1].instances
    group = holders + tuple(i for i in grown if i not in holders)
    plan = PrefillPlan(f"{case}-cached", len(ids), (Chunk(cached, len(ids), group),),
                       cached_tokens=cached, cached_instances=holders,
                       cached_source=source.request_id).validate(4)
    res = pool.run(plan, ids, return_logits=True)
    got = _same_as_reference(pool, model, res, plan.request_id, ids)
    assert res.first_token == base.first_token
    torch.testing.assert_close(got, torch.tensor(base.logits), rtol=1e-4, atol=1e-5)
    if case == "sharded":
        assert len(holders) == 2 and res.balance_moved_tokens > 0   # the prefix was spread
    # The source can go at once: the run holds its own copy.
    pool.release(source.request_id)
    parts = pool.export_kv(plan.request_id)
    assert sum(p.numel() for p, _, _ in parts.values()) == len(ids)
    for r in (plain.request_id, plan.request_id):
        pool.release(r)
    assert not any(pool.held_requests().values())


def test_the_index_drives_what_the_pool_keeps(pool, model, deployment):
    """Two questions about one document and a second turn, planned by the control plane from
    its index: each runs from the cache, equals single-instance prefill, and once the index
    lets a run go and the cache is cleared the pool holds nothing."""
    index = PrefixIndex(BLOCK, capacity_blocks=64)
    queue = PrefillQueue(pool.node_of)
    cp = ControlPlane(policy_from_config(deployment.scheduler), queue, None,
                      improvement_rate=0.3, prefix_index=index)
    doc = prompt(608, seed=5)
    turn1 = doc + prompt(40, seed=6)
    prompts = {"q1": turn1, "q2": doc + prompt(90, seed=7), "t2": turn1 + prompt(70, seed=8)}
    released: list[str] = []
    for now, (run, ids) in enumerate(prompts.items()):
        plan = cp.plan(run, len(ids), float(now), block_hashes=index.hashes(ids))
        cp.commit(plan)
        res = pool.run(plan, ids, return_logits=True)
        cp.prefill_done(run, float(now) + 0.5)
        _same_as_reference(pool, model, res, run, ids)
        cp.prefix_cached(run)
        for gone in cp.prefix_released():
            pool.release(gone)
            released.append(gone)
        if run != "q1":
            assert plan.cached_tokens >= 608 and plan.cached_source in ("q1", "q2")
        cp.finished(run, float(now) + 1.0)
    assert index.stats()["hits"] == 2
    for gone in index.clear():
        pool.release(gone)
        released.append(gone)
    index.check()
    assert sorted(released) == sorted(prompts)
    assert not any(pool.held_requests().values())


def test_interleaved_runs_stay_exact_while_the_cache_evicts(pool, model, deployment):
    """An index of 48 blocks (768 tokens) for prompts of 500-700 tokens: runs interleave
    with their sources' evictions, hits shrink to what is left of a prefix (the deepest
    blocks go first), and every run equals single-instance prefill; nothing leaks."""
    index = PrefixIndex(BLOCK, capacity_blocks=48)
    cp = ControlPlane(policy_from_config(deployment.scheduler), PrefillQueue(pool.node_of), None,
                      improvement_rate=0.3, prefix_index=index)
    docs = [prompt(480, seed=40 + d) for d in range(2)]
    order = [(0, 20), (1, 30), (0, 200), (1, 25), (0, 35)]   # (document, question tokens)
    hits, released = [], []
    for k, (d, q) in enumerate(order):
        run, ids = f"ev{k}", docs[d] + prompt(q, seed=60 + k)
        plan = cp.plan(run, len(ids), float(k), block_hashes=index.hashes(ids))
        cp.commit(plan)
        res = pool.run(plan, ids, return_logits=True)
        _same_as_reference(pool, model, res, run, ids)
        cp.prefill_done(run, k + 0.5)
        cp.prefix_cached(run)
        cp.finished(run, k + 0.9)
        hits.append(plan.cached_tokens)
        for gone in cp.prefix_released():
            pool.release(gone)
            released.append(gone)
        index.check()
    # Each run's blocks evict the least recent chains' deepest blocks: every later run hits
    # only what is left of its document (whole blocks, less than the 480 shared tokens).
    assert hits[:2] == [0, 0]
    assert all(0 < h < 480 and h % BLOCK == 0 for h in hits[2:]), hits
    assert released   # evictions let sources go while later runs went on
    for gone in index.clear():
        pool.release(gone)
        released.append(gone)
    assert sorted(released) == sorted(f"ev{k}" for k in range(len(order)))
    assert not any(pool.held_requests().values())


def test_a_prefix_gone_from_its_holders_fails_the_run_as_plan_again(pool):
    from tetris.errors import PlanOutdated, PrefixMissing

    ids = prompt(300, seed=9)
    source = forced_plan("gone-src", 300, "restx2", pool.node_of)
    pool.run(source, ids)
    pool.release(source.request_id)          # e.g. its worker was replaced: the KV is gone
    plan = PrefillPlan("gone", 300, (Chunk(256, 300, source.instances),), cached_tokens=256,
                       cached_instances=source.instances, cached_source="gone-src")
    with pytest.raises(PrefixMissing) as err:
        pool.run(plan, ids)
    assert isinstance(err.value, PlanOutdated) and err.value.source == "gone-src"
    assert not any(pool.held_requests().values())


def test_a_run_from_a_prefix_still_being_prefilled_waits_for_it(pool, model):
    """The source is committed first; the run reading its prefix is committed and started
    before the source runs at all: its copy waits for its turn on the holders, after the
    source's chunks, and the result equals single-instance prefill."""
    import threading

    src_ids = prompt(700, seed=21)
    ids = src_ids[:640] + prompt(90, seed=22)
    source = forced_plan("pending-src", 700, "300x1,restx2", pool.node_of)
    group = source.instances + tuple(i for i in range(4) if i not in source.instances)
    plan = PrefillPlan("pending-run", len(ids), (Chunk(640, len(ids), group),), cached_tokens=640,
                       cached_instances=source.instances, cached_source=source.request_id)
    pool.commit(source)
    pool.commit(plan)
    got = {}
    reader = threading.Thread(target=lambda: got.update(res=pool.run(plan, ids,
                                                                      return_logits=True)))
    reader.start()
    pool.run(source, src_ids)
    reader.join(timeout=120)
    assert not reader.is_alive() and "res" in got
    _same_as_reference(pool, model, got["res"], plan.request_id, ids)
    for r in (source.request_id, plan.request_id):
        pool.release(r)
    assert not any(pool.held_requests().values())


# -- a cached prefix moved to a first group without its holders (prefix_move.py) -----------
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
    _same_as_reference(pool, model, res, plan.request_id, ids)
    parts = pool.export_kv(plan.request_id)
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
        _same_as_reference(pool, model, res, plan.request_id, ids)
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
    _same_as_reference(pool, model, res, "mv-fail-2", ids)
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
    _same_as_reference(pool, model, got["res"], plan.request_id, ids)
    for r in (source.request_id, plan.request_id):
        pool.release(r)
    assert not any(pool.held_requests().values())


# -- a cached prefix under CSPS layouts (the planner gives cached plans layouts: 839ccae) ---
@pytest.mark.parametrize("case,moved,layout,micro", [
    ("extend-a2a", False, "a2a", 1),        # the holders' group grown, Ulysses over history
    ("extend-sptp", False, "sptp", 1),      # SP-TP reads the cached history's KV heads
    ("moved-a2a-pipelined", True, "a2a", 2),
    ("moved-ring-pieces", True, "ring", 2),
])
def test_a_cached_prefix_is_history_to_every_layout(pool, model, case, moved, layout, micro):
    src_ids = prompt(600, seed=41)
    ids = src_ids[:560] + prompt(60, seed=42)
    source = forced_plan(f"lay-{case}-src", len(src_ids), "300x1,restx2", pool.node_of)
    pool.run(source, src_ids)
    group = (2, 3) if moved else (*source.instances, 2, 3)
    chunk = Chunk(560, len(ids), group, sp_layout=layout, sp_micro_partitions=micro)
    plan = PrefillPlan(f"lay-{case}", len(ids), (chunk,), cached_tokens=560,
                       cached_instances=source.instances, cached_source=source.request_id,
                       cached_moved=moved).validate(4)
    res = pool.run(plan, ids, return_logits=True)
    _same_as_reference(pool, model, res, plan.request_id, ids)
    for r in (source.request_id, plan.request_id):
        pool.release(r)
    assert not any(pool.held_requests().values())
