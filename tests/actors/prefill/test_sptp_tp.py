"""SP-TP on TP-2 prefill instances (actors/prefill/sptp.py, "Members that are TP > 1
instances") against the single engine, without Ray.

Two processes are the two TP ranks (head slices) of every instance; in each, the pool's
instances are threads (``ThreadedPool``) whose gloo world is that head slice's world (the TP
ranks ``t`` of the instances, as ``tp_groups.SliceWorld``), and each instance's TP group is its
own gloo group over the two processes (its ``o_proj`` and MLP all-reduces, and SP-TP's sum over
the slices). Plans: ``sptp`` chunks with history, KV heads replicated and hierarchical across
nodes, and a plan mixing a2a, sptp and ring chunks. Each rank's last-token logits, greedy token
and KV head slice are compared with the TP-1 reference. A group that cannot split an
instance's heads is refused before any member runs, and dropping the instance's all-reduce
(SP-TP as if TP-1) breaks the logits: the composition is what makes them equal."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cdsp_check import prompt, reference

TP = 2
NODE_OF = (0, 0, 1, 1)
PLANS = [
    # history; 4 members over the slice's 1 KV head, hierarchical across the 2 nodes
    ("200x1,200x2:sptp,restx4:sptp", 600, ["ring", "sptp", "sptp"]),
    ("200x2:a2a,200x2:sptp,restx4", 600, ["a2a", "sptp", "ring"]),     # three layouts
]


def _pool(deployment):
    """4 instances as threads of this process (threaded_tp.py), each on its own TP group."""
    from tetris.actors.prefill.threaded_tp import ThreadedTpRank, instance_tp_groups

    pool = ThreadedTpRank(deployment.model, instance_tp_groups(len(NODE_OF)), num_blocks=96,
                          block_size=16, timeout_s=30.0, node_of=NODE_OF)
    return pool, pool.models[0]


def _run(pool, model, spec: str, n: int):
    from tetris.actors.prefill.layout import forced_plan

    plan = forced_plan(f"tp-{spec}", n, spec, NODE_OF, num_kv_heads=model.local_num_kv_heads,
                       num_heads=model.local_num_heads)
    res = pool.run(plan, prompt(n, n), return_logits=True)
    kv = {i: pool.kv(plan.request_id, i) for i in plan.instances}
    pool.release(plan.request_id)
    return ([c.sp_layout for c in plan.chunks], res.first_token, torch.tensor(res.logits), kv,
            res.sent_elements)


def _refusal(pool, model) -> str:
    """A forced ``sptp`` chunk on 3 instances (not checked by the plan): 3 does not divide the
    instance's 4 query heads."""
    from tetris.actors.prefill.layout import forced_plan

    plan = forced_plan("tp-bad", 200, "100x1,restx3:sptp", NODE_OF)
    try:
        pool.run(plan, prompt(200, 1))
    except ValueError as e:
        return str(e)
    return ""


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from tetris.actors.prefill import sptp

    from tetris.config import load_deployment

    dist.init_process_group("gloo", store=dist.FileStore(store_path, TP), rank=rank,
                            world_size=TP)
    try:
        pool, model = _pool(load_deployment("tiny-cpu.toml"))
        out = {"runs": [_run(pool, model, spec, n) for spec, n, _ in PLANS],
               "refusal": _refusal(pool, model)}
        # SP-TP without the instance's all-reduce: each rank keeps its own slice's part
        sptp._instance_sum = lambda model, part: part
        out["no_all_reduce"] = _run(pool, model, "300x2:sptp", 300)[2]
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sptp_tp")
    mp.spawn(_worker, args=(str(d / "store"), str(d)), nprocs=TP)
    return [torch.load(d / f"rank{t}.pt") for t in range(TP)]


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("k", range(len(PLANS)))
def test_sptp_on_tp2_instances_matches_the_single_engine(tp_runs, model, k):
    spec, n, layouts = PLANS[k]
    ref_logits, ref_k, ref_v = reference(model, prompt(n, n))
    hkv = model.local_num_kv_heads // TP   # KV heads of one TP rank's slice
    for t, out in enumerate(tp_runs):
        got_layouts, token, logits, kv, _sent = out["runs"][k]
        assert got_layouts == layouts
        assert _rel(logits, ref_logits) < 1e-4, (spec, t)
        assert token == int(ref_logits.argmax())
        pos = torch.cat([p for p, _, _ in kv.values()])
        assert sorted(pos.tolist()) == list(range(n))
        heads = slice(t * hkv, (t + 1) * hkv)   # rank t holds head slice t
        k_t = torch.cat([kk for _, kk, _ in kv.values()], dim=1)
        v_t = torch.cat([vv for _, _, vv in kv.values()], dim=1)
        assert k_t.shape[2] == hkv
        torch.testing.assert_close(k_t, ref_k[:, pos][:, :, heads], rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(v_t, ref_v[:, pos][:, :, heads], rtol=1e-4, atol=2e-5)


def test_each_head_slice_sends_what_the_cost_model_charges(tp_runs, deployment):
    """Plan 0's two SP-TP chunks (h = 200, l = 200 on 2; h = 400, l = 200 on 4): each slice
    world moves the model's whole rows plus its slice's history KV, as ``layout_volume`` says
    for the per-instance geometry (sp_comm.py), every layer."""
    from tetris.scheduler.sp_comm import ModelGeometry, layout_volume

    g = ModelGeometry.from_model_config(deployment.model, TP)
    want = g.num_layers * (layout_volume("sptp", g, 2, 200, 200)
                           + layout_volume("sptp", g, 4, 400, 200))
    assert g.model_hidden == deployment.model.hidden_size
    for out in tp_runs:
        assert out["runs"][0][4] == want


def test_a_group_that_cannot_split_an_instances_heads_is_refused(tp_runs):
    for out in tp_runs:
        assert "chunk 1: sptp: a group of 3 does not divide 4 heads" in out["refusal"]


def test_without_the_instance_all_reduce_the_logits_differ(tp_runs, model):
    """The tiny model's attention is a small part of its residual stream: missing half of
    it moves the logits ~1% here, still far past the 1e-4 the plans are held to."""
    ref_logits = reference(model, prompt(300, 300))[0]
    for out in tp_runs:
        assert _rel(out["no_all_reduce"], ref_logits) > 1e-3
