"""CSA in the prefill pool (LOSSY, opt-in): the in-process pool's ring chunks with ``[csa]``
on. Zero drop gives the dense single engine's logits and KV; drop ratios above zero give the
single-engine CSA reference's (engine/csa_prefill.py) on the same shards and nodes, chunk for
chunk; the ring sends less; off, the tasks are those of a pool without CSA."""

from __future__ import annotations

import pytest
import torch
from cdsp_check import check_plan, prompt
from tetris.actors.prefill.chunks import RunOptions, chunk_task
from tetris.actors.prefill.layout import forced_plan, plan_layout
from tetris.actors.prefill.threaded import ThreadedPool
from tetris.kernels.csa import CsaLayout

from tetris.config import CsaConfig, load_deployment
from tetris.engine.csa_prefill import csa_chunked_prefill
from tetris.token_ids import compact_tokens

NODES = (0, 0, 1, 1)


@pytest.fixture(scope="module")
def csa_pool(model):
    return ThreadedPool(model, 4, num_blocks=64, block_size=16, timeout_s=20.0, node_of=NODES)


def _reference_chunks(plan, node_of, balance):
    """(start, end, layout) per chunk: every position held by the member that holds it while
    the chunk runs (its history after balancing, its zigzag share), members' nodes."""
    layouts, _ = plan_layout(plan, balance)
    out = []
    for c, lay in zip(plan.chunks, layouts):
        owner = [0] * c.end
        for r in range(len(lay.group)):
            for lo, hi in tuple(lay.history[r]) + tuple(lay.chunk_positions[r]):
                owner[lo:hi] = [r] * (hi - lo)
        out.append((c.start, c.end, CsaLayout.of_owners(owner, [node_of[i] for i in lay.group])))
    return out


@pytest.mark.parametrize("n,spec", [(300, "300x4"), (520, "200x2,restx4"),
                                    (105, "100x2,5x4")])   # 5 tokens on 4: idle members
def test_zero_drop_equals_the_dense_single_engine(csa_pool, model, n, spec):
    plan = forced_plan(f"csa0-{spec}", n, spec, NODES)
    zero = CsaConfig(enabled=True, level2_drop_ratio=0.0, level3_drop_ratio=0.0)
    check_plan(csa_pool, model, plan, prompt(n, n), csa=zero)   # logits 1e-4, tokens, KV
    csa_pool.release(plan.request_id)


@pytest.mark.parametrize("n,spec,p2,drop_queries", [
    (300, "300x4", 0.25, True), (520, "200x2,restx4", 0.2, True),
    (520, "200x2,restx4", 0.0, False)])
@torch.inference_mode()
def test_drops_equal_the_single_engine_csa_reference(csa_pool, model, n, spec, p2,
                                                     drop_queries):
    plan = forced_plan(f"csa-{spec}-{p2}-{drop_queries}", n, spec, NODES)
    ids = prompt(n, n + 1)
    cfg = CsaConfig(enabled=True, level2_drop_ratio=p2, drop_queries=drop_queries)
    res = csa_pool.run(plan, ids, return_logits=True, csa=cfg, balance="overlap")
    csa_pool.release(plan.request_id)
    dense = csa_pool.run(plan, ids, return_logits=True, balance="overlap")
    csa_pool.release(plan.request_id)
    ref = csa_chunked_prefill(model, torch.tensor(ids), _reference_chunks(plan, NODES, "overlap"),
                              cfg, drop_queries=drop_queries)[-1]
    got, dense_logits = torch.tensor(res.logits), torch.tensor(dense.logits)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"pool CSA and the single-engine CSA differ by {rel:.2e} relative"
    assert res.first_token == int(ref.argmax())
    assert (got - dense_logits).abs().max() > 1e-3   # it is lossy: the drop changed logits
    # layers 1 and 2 of the 4 drop; the ring carried fewer KV elements than the dense ring
    assert 0 < res.sent_elements < dense.sent_elements


def test_off_leaves_every_task_as_without_csa():
    plan = forced_plan("csa-off", 520, "200x2,restx4", NODES)
    layouts, _ = plan_layout(plan, "overlap")
    ids = compact_tokens(prompt(520, 0))

    def tasks(csa):
        opts = RunOptions("overlap", None, False, (), None, None, csa=csa)
        return [chunk_task(plan, k, r, lay, ids, 7, opts, 0, timeout_s=9.0, emulated=False,
                           node_of=NODES)
                for k, lay in enumerate(layouts) for r in range(len(lay.group))]

    plain = tasks(None)
    assert tasks(CsaConfig()) == plain   # [csa] present but not enabled: nothing changes
    on = tasks(CsaConfig(enabled=True, level2_drop_ratio=0.2))
    assert [t.csa_drop_ratios for t in on] == [pytest.approx((0.0, 0.2, 0.6))] * len(on)
    assert on[-1].sp_member_nodes == tuple(NODES[i] for i in on[-1].group)
    assert all(not t.csa_drop_ratios and not t.sp_member_nodes for t in plain)


def test_the_deployment_section_reaches_the_tasks(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text('[model]\nname = "tiny"\n[csa]\nenabled = true\nlevel2_drop_ratio = 0.4\n'
                    'drop_queries = false\n')
    csa = load_deployment(str(path)).csa
    plan = forced_plan("csa-cfg", 300, "300x4", NODES)
    lay = plan_layout(plan, "off")[0][0]
    task = chunk_task(plan, 0, 1, lay, compact_tokens(prompt(300, 0)), 1,
                      RunOptions("off", None, False, (), None, None, csa=csa), 0,
                      timeout_s=9.0, emulated=False, node_of=NODES)
    assert task.csa_drop_ratios == pytest.approx((0.0, 0.4, 0.7))
    assert task.csa_drop_queries is False
