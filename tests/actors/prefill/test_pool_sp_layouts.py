"""SP-NTP (all-to-all) chunks, pipelined or not, and plans that mix layouts on a pool of 4 Ray
actors over 2 nodes (gloo), against single-instance prefill of the tiny model (8 heads, 2 KV
heads: groups of 1 and 2 run all-to-all, a group of 4 with each KV head on 2 members)."""

from __future__ import annotations

import pytest
import torch
from prefill_reference import reference

from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.zigzag import ranges_to_list

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("n,spec,layouts", [
    (700, "700x2:a2a", ["a2a"]),                                    # no history
    (900, "300x2:a2a,restx2:a2a", ["a2a", "a2a"]),                  # history from an a2a chunk
    (1100, "300x1,400x2:a2a,restx4", ["ring", "a2a", "ring"]),      # mixed, balanced history
    (1000, "300x2,restx2:a2a", ["ring", "a2a"]),                    # a2a over a ring's history
    (800, "300x1:a2a,restx4:a2a", ["a2a", "a2a"]),                  # group of 4: KV heads replicated
    # three-phase pipelining: pipelined a2a with history, mixed with the ring and plain a2a
    (900, "300x2:a2a/3,restx2:a2a/4", ["a2a", "a2a"]),
    (1100, "300x1,400x2:a2a/5,restx4", ["ring", "a2a", "ring"]),
    # SP-TP: the group of 4 spans both nodes, so its collectives run hierarchically
    (1000, "300x2:sptp,restx4:sptp", ["sptp", "sptp"]),
    # the ring over micro-partitions (ring_pipeline.py) between a whole-block ring chunk and one
    # over 3 pieces, on the Ray workers
    (1000, "300x1,400x2:ring/4,restx4:ring/3", ["ring", "ring", "ring"]),
])
def test_sp_ntp_and_mixed_plans_match_single_instance(pool, model, n, spec, layouts):
    ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    plan = forced_plan(f"sp-{spec}", n, spec, pool.node_of, num_kv_heads=2, num_heads=8)
    assert [c.sp_layout for c in plan.chunks] == layouts
    res = pool.run(plan, ids, return_logits=True)
    ref_logits, ref_k, ref_v = reference(model, ids)
    got = torch.tensor(res.logits)
    rel = ((got - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < 1e-4, f"last-token logits differ by {rel:.2e} relative"
    assert res.first_token == int(ref_logits.argmax())       # the greedy token
    # What the members store is the single instance's KV, laid out as under the ring.
    parts = pool.export_kv(plan.request_id)
    pos = torch.cat([p for p, _, _ in parts.values()])
    assert sorted(pos.tolist()) == list(range(n))
    torch.testing.assert_close(torch.cat([k for _, k, _ in parts.values()], dim=1),
                               ref_k[:, pos], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([v for _, _, v in parts.values()], dim=1),
                               ref_v[:, pos], rtol=1e-4, atol=1e-5)
    layout = dict(res.kv_layout)
    for i, (p, _, _) in parts.items():
        assert p.tolist() == ranges_to_list(layout[i])
    pool.release(plan.request_id)
