"""The seeded tiny model of the engine tests and a cache-free greedy reference."""

from __future__ import annotations

import torch

from tetris.config import ModelConfig
from tetris.engine.logprobs import logprobs_of_rows
from tetris.kernels.attention import attention_with_lse_ref
from tetris.model.loader import load_model

TINY = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, max_position_embeddings=256, seed=3)


_MODEL = []


def tiny_model():
    """(model, tokenizer), built once per test session."""
    if not _MODEL:
        _MODEL.append(load_model(TINY))
    return _MODEL[0]


def causal_op(layer, q, k, v):
    return attention_with_lse_ref(q, k, v, causal=True)[0]


@torch.inference_mode()
def prefill_kv(model, prompt):
    """The prompt's per-layer K/V as one prefill outside any engine computes them, and the
    logits row of its last position (what a prefill instance streams and samples from)."""
    kv = []

    def capture(layer, q, k, v):
        kv.append((k.clone(), v.clone()))
        return causal_op(layer, q, k, v)

    hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), capture)
    return kv, model.logits(hidden[-1:])


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by recomputing the whole sequence each step: no cache, no batching."""
    tokens = list(prompt)
    for _ in range(n):
        ids = torch.tensor(tokens)
        hidden = model.forward(ids, torch.arange(len(tokens)), causal_op)
        tokens.append(int(model.logits(hidden[-1:]).argmax(-1)))
    return tokens[len(prompt):]


@torch.inference_mode()
def reference_logprobs(model, prompt: list[int], outputs: list[int], top: int) -> list:
    """``TokenLogprob`` of each output token from one cache-free forward of the whole sequence:
    position p's logits give the logprob of token p + 1."""
    tokens = list(prompt) + list(outputs)
    hidden = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), causal_op)
    rows = model.logits(hidden[len(prompt) - 1:-1])
    return logprobs_of_rows(rows, outputs, top)
