"""Fused q/k/v and gate/up GEMMs: the member weights alias one tensor, loads land in it, and
a broken alias falls back to per-member GEMMs with the same results."""

from __future__ import annotations

import torch

from model_helpers import CFG, logits_of

from tetris.model.loader import load_model
from tetris.model.weights import load_tensor


def _unfused_layer_qkv(model, i, hidden, positions):
    """The projections one by one, as HF computes them."""
    layer = model.layers[i]
    x = layer.input_layernorm(hidden)
    t, d = hidden.shape[0], model.head_dim
    q = torch.nn.functional.linear(x, layer.self_attn.q_proj.weight).view(t, -1, d)
    k = torch.nn.functional.linear(x, layer.self_attn.k_proj.weight).view(t, -1, d)
    v = torch.nn.functional.linear(x, layer.self_attn.v_proj.weight).view(t, -1, d)
    cos, sin = model.rotary.cos_sin(positions, hidden.dtype)
    return model.rotary.rotate(q, cos, sin), model.rotary.rotate(k, cos, sin), v


def test_fused_qkv_equals_separate_projections():
    model, _ = load_model(CFG)
    attn = model.layers[0].self_attn
    assert attn.qkv.aliased() and model.layers[1].mlp.gate_up.aliased()
    hidden = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([0, 3, 4, 9, 2])
    got = model.layer_qkv(0, hidden, positions)
    want = _unfused_layer_qkv(model, 0, hidden, positions)
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous()
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_loading_a_member_updates_the_fused_weight():
    model, _ = load_model(CFG)
    before = logits_of(model)
    full = torch.randn(CFG.num_kv_heads * model.head_dim, CFG.hidden_size)
    load_tensor(model, "model.layers.1.self_attn.v_proj.weight", full)
    fused = model.layers[1].self_attn.qkv
    assert fused.aliased()
    torch.testing.assert_close(fused.weight[-full.shape[0]:], full)
    assert not torch.allclose(logits_of(model), before)


def test_broken_alias_falls_back_to_member_weights():
    model, _ = load_model(CFG)
    want = logits_of(model)
    mlp = model.layers[0].mlp
    # Replacing a member's parameter (as module.to() does) must not leave a stale fused copy.
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.clone(), requires_grad=False)
    assert not mlp.gate_up.aliased()
    torch.testing.assert_close(logits_of(model), want)
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2.0)
    assert not torch.allclose(logits_of(model), want)
