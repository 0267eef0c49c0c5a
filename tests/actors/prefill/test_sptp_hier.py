"""Hierarchical SP-TP collectives (actors/prefill/sptp_hier.py) over gloo with ranks as
threads: the attention block equals the model's own over the whole sequence, and the elements
crossing nodes are one copy per node pair, G times fewer than the flat collectives'."""

from __future__ import annotations

import pytest
import torch
from gloo_threads import run_ranks
from tetris.actors.prefill.balance import plan_balance
from tetris.actors.prefill.kv_store import ranges_tensor
from tetris.actors.prefill.sptp_hier import HierarchicalSpTp, RailSpTp
from tetris.actors.prefill.zigzag import zigzag_layout
from tetris.kernels.attention import attention_with_lse_ref


@pytest.mark.parametrize("cls,nodes,hist", [
    (HierarchicalSpTp, (0, 0, 1, 1), 0), (HierarchicalSpTp, (0, 1, 1, 0), 27),
    (HierarchicalSpTp, (0, 1, 1, 2), 13),
    (RailSpTp, (0, 0, 1, 1), 0), (RailSpTp, (0, 1, 1, 0), 27), (RailSpTp, (0, 1, 2, 3), 13)])
@torch.inference_mode()
def test_hierarchical_attention_block_matches_and_crosses_nodes_once(model, cls, nodes, hist):
    s, i, end = len(nodes), 2, hist + 47
    d = model.embed_tokens.weight.shape[1]
    x = torch.randn(end, d, generator=torch.Generator().manual_seed(hist))
    q, k, v = model.layer_qkv(i, x, torch.arange(end))
    ref = model.layer_attn_out(i, x, attention_with_lse_ref(q, k, v, causal=True)[0])
    _, after = plan_balance(list(zigzag_layout(0, hist, 2)), tuple(range(s)))
    chunk = zigzag_layout(hist, end, s)
    q_pos = [ranges_tensor(c) for c in chunk]
    blocks = [ranges_tensor(tuple(sorted(after[r] + chunk[r]))) for r in range(s)]

    def member(r, world):
        sp = cls(tuple(range(s)), r, q_pos, blocks, hist, tag=4, timeout_s=20.0,
                 link=world, member_nodes=nodes)
        out = sp.attention_block(model, i, x[q_pos[r]], k[blocks[r]], v[blocks[r]])
        return out, sp.inter_node_elements

    outs = run_ranks(s, member)
    for r in range(s):
        torch.testing.assert_close(outs[r][0], ref[q_pos[r]], rtol=1e-5, atol=1e-5)
    n = [p.numel() for p in q_pos]
    hist_rows = [b[b < hist].numel() for b in blocks]
    per_node = {}
    for j, a in enumerate(nodes):
        per_node[a] = per_node.get(a, 0) + n[j]
    # each node's rows go once to every other node (all-gather), and every node receives once
    # the sums for its rows from every other node (reduce-scatter); history KV goes directly
    # (one KV head of d_h = 32 per member: 4 members over 2 KV heads)
    hier = sum(2 * per_node[a] * d * (len(per_node) - 1) for a in per_node)
    hist_kv = sum(hist_rows[r] * 2 * 32 for r in range(s) for j in range(s)
                  if nodes[j] != nodes[r])
    assert sum(e for _, e in outs) == hier + hist_kv
    flat = sum(2 * n[r] * d * sum(nodes[j] != nodes[r] for j in range(s)) for r in range(s))
    if nodes.count(0) == 2 and len(per_node) == 2:
        assert flat == 2 * hier          # G = 2 members per node: half the inter-node bytes


@pytest.mark.parametrize("n,spec", [(900, "300x2:sptp,restx4:sptp"), (800, "300x1,restx4:sptp")])
def test_pool_runs_sptp_hierarchically_across_nodes(model, monkeypatch, n, spec):
    """A ThreadedPool told its instances' nodes hands SP-TP chunks spanning nodes the
    hierarchical collectives, and the plan still matches the single instance."""
    from cdsp_check import check_plan, prompt
    from tetris.actors.prefill.layout import forced_plan
    from tetris.actors.prefill.threaded import ThreadedPool

    calls = []
    block = HierarchicalSpTp.attention_block
    monkeypatch.setattr(HierarchicalSpTp, "attention_block",
                        lambda self, *a, **kw: calls.append(self.rank) or block(self, *a, **kw))
    node_of = (0, 0, 1, 1)
    pool = ThreadedPool(model, 4, num_blocks=96, block_size=16, timeout_s=20.0, node_of=node_of)
    plan = forced_plan(f"hier-{spec}", n, spec, node_of, num_kv_heads=2, num_heads=8)
    check_plan(pool, model, plan, prompt(n, n + 2))
    spanning = [c for c in plan.chunks if len({node_of[i] for i in c.instances}) > 1]
    assert spanning and len(calls) == model.num_layers * sum(c.sp_size for c in spanning)
    pool.release(plan.request_id)
