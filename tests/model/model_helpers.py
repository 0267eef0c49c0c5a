"""A small seeded Llama and a causal forward to its logits, shared by the model tests."""

from __future__ import annotations

import torch

from tetris.config import ModelConfig
from tetris.kernels.attention import attention_with_lse

CFG = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, seed=5)


def causal(i, q, k, v):
    return attention_with_lse(q, k, v, causal=True)[0]


def logits_of(model) -> torch.Tensor:
    """Logits of a fixed 12-token prompt through ``model`` (causal attention, no cache)."""
    ids = torch.arange(12) * 13 % CFG.vocab_size
    with torch.inference_mode():
        return model.logits(model(ids, torch.arange(12), causal))
