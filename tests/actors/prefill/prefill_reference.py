"""Single-instance prefill, the reference every pool plan is compared with."""

from __future__ import annotations

import torch
from tetris.kernels.dispatch import attention_with_lse


def prompt(n: int, seed: int) -> list[int]:
    """``n`` seeded token ids of the tiny model's vocabulary."""
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, ids):
    """Last-token logits [V] and per-layer K, V [L, T, Hkv, D] of single-instance prefill."""
    ks, vs = [], []

    def causal(i, q, k, v):
        ks.append(k)
        vs.append(v)
        return attention_with_lse(q, k, v, causal=True)[0]

    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), causal)
    return model.logits(hidden[-1:])[0], torch.stack(ks), torch.stack(vs)
