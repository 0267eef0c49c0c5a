"""SP-NTP (all-to-all) chunks, pipelined or not, and plans that mix layouts on a pool of 4 Ray
actors over 2 nodes (gloo), against single-instance prefill of the tiny model (8 heads, 2 KV
heads: groups of 1 and 2 run all-to-all, a group of 4 falls back to the ring)."""

from __future__ import annotations

import pytest
import torch
from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.zigzag import ranges_to_list
from tetris.kernels.dispatch import attention_with_lse

from tetris.config import load_deployment

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def deployment():
    return load_deployment("tiny-cpu.toml")


@pytest.fixture(scope="module")
def pool(ray_session, deployment):
    from tetris.actors.prefill.pool import PrefillPool

    p = PrefillPool(deployment, num_instances=4, node_size=2, timeout_s=8.0)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def model(deployment):
    from tetris.model.loader import load_model

    torch.set_num_threads(1)
    return load_model(deployment.model)[0]


def _reference(model, ids):
    """Last-token logits [V] and per-layer K, V [L, T, Hkv, D] of single-instance prefill."""
    ks, vs = [], []

    def causal(i, q, k, v):
        ks.append(k)
        vs.append(v)
        return attention_with_lse(q, k, v, causal=True)[0]

    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), causal)
    return model.logits(hidden[-1:])[0], torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("n,spec,layouts", [
    (700, "700x2:a2a", ["a2a"]),                                    # no history
    (900, "300x2:a2a,restx2:a2a", ["a2a", "a2a"]),                  # history from an a2a chunk
    (1100, "300x1,400x2:a2a,restx4", ["ring", "a2a", "ring"]),      # mixed, balanced history
    (1000, "300x2,restx2:a2a", ["ring", "a2a"]),                    # a2a over a ring's history
    (800, "300x1:a2a,restx4:a2a", ["a2a", "ring"]),                 # group of 4: the ring
    # three-phase pipelining: pipelined a2a with history, mixed with the ring and plain a2a
    (900, "300x2:a2a/3,restx2:a2a/4", ["a2a", "a2a"]),
    (1100, "300x1,400x2:a2a/5,restx4", ["ring", "a2a", "ring"]),
])
def test_sp_ntp_and_mixed_plans_match_single_instance(pool, model, n, spec, layouts):
    ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    plan = forced_plan(f"sp-{spec}", n, spec, pool.node_of, num_kv_heads=2)
    assert [c.sp_layout for c in plan.chunks] == layouts
    res = pool.run(plan, ids, return_logits=True)
    ref_logits, ref_k, ref_v = _reference(model, ids)
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
