"""CDSP prefill checked against the single instance, on whatever device the model is on.

``reference`` is single-instance prefill (one causal attention over the whole prompt);
``check_plan`` runs a plan on a pool (Ray's ``PrefillPool`` or the in-process ``ThreadedPool``)
and asserts that the first token, the last-token logits and the union of the members' KV equal
the reference's.
"""

from __future__ import annotations

import torch

from tetris.kernels.dispatch import attention_with_lse


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    """``n`` seeded token ids below ``vocab``."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def reference(model, ids):
    """Last-token logits [V] and per-layer K, V [L, T, Hkv, D] of single-instance prefill."""
    ks, vs = [], []

    def causal(i, q, k, v):
        ks.append(k)
        vs.append(v)
        return attention_with_lse(q, k, v, causal=True)[0]

    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), causal)
    return model.logits(hidden[-1:])[0], torch.stack(ks), torch.stack(vs)


def check_plan(pool, model, plan, ids, *, rtol: float = 1e-4, **run_kw):
    """Run ``plan`` and compare with ``reference``; returns the pool's result."""
    with torch.inference_mode():
        res = pool.run(plan, ids, return_logits=True, **run_kw)
    ref_logits, ref_k, ref_v = reference(model, ids)
    ref_logits = ref_logits.float().cpu()
    got = torch.tensor(res.logits)
    rel = ((got - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < rtol, f"last-token logits differ by {rel:.2e} relative"
    assert res.first_token == int(ref_logits.argmax())
    # The union of the members' KV is the single-instance KV, every layer and position.
    parts = {i: pool.kv(plan.request_id, i) for i in plan.instances}
    pos = torch.cat([p for p, _, _ in parts.values()])
    assert sorted(pos.tolist()) == list(range(len(ids)))
    k = torch.cat([k for _, k, _ in parts.values()], dim=1).float().cpu()
    v = torch.cat([v for _, _, v in parts.values()], dim=1).float().cpu()
    idx = pos.cpu()
    torch.testing.assert_close(k, ref_k.float().cpu()[:, idx], rtol=rtol, atol=10 * rtol)
    torch.testing.assert_close(v, ref_v.float().cpu()[:, idx], rtol=rtol, atol=10 * rtol)
    return res
