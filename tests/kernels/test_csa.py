"""CSA (kernels/csa.py, tetris/engine/csa_prefill.py): exact at zero drop, drop counts, Eq. 5."""

from __future__ import annotations

import math

import pytest
import torch
from tetris.kernels.attention import attention_with_lse_ref
from tetris.kernels.csa import CsaLayout, csa_attention, keep_masks, level_drop_ratios

from tetris.config import CsaConfig, ModelConfig, load_deployment
from tetris.engine.csa_prefill import CsaPrefill
from tetris.model.loader import load_model


def _qkv(t, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Queries scaled up so attention is far from uniform (a dropped key then matters).
    return (3 * torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g),
            torch.randn(t, hkv, d, generator=g))


@pytest.mark.parametrize("shards,per_node,t", [(4, 2, 37), (4, 4, 16), (3, 1, 11), (1, 1, 9)])
def test_zero_drop_equals_dense_causal_attention(shards, per_node, t):
    q, k, v = _qkv(t)
    layout = CsaLayout.even(t, shards, per_node)
    ref_out, ref_lse = attention_with_lse_ref(q, k, v, causal=True)
    importance = torch.rand(t, 2, generator=torch.Generator().manual_seed(1))
    for keep in ([], keep_masks(importance, layout, (0.0, 0.0, 0.0))):
        out, lse, _, _ = csa_attention(q, k, v, layout, keep)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_drop_ratio_gives_exact_counts_nested_and_ties_by_position():
    layout = CsaLayout.even(40, 4, 2)  # 4 shards of 10
    importance = torch.rand(40, 3, generator=torch.Generator().manual_seed(2))
    keep = keep_masks(importance, layout, (0.0, 0.3, 0.55))
    for s in range(4):
        rows = slice(10 * s, 10 * s + 10)
        assert keep[0][rows].sum(0).tolist() == [10, 10, 10]
        assert keep[1][rows].sum(0).tolist() == [7, 7, 7]  # floor(0.3·10) = 3 dropped
        assert keep[2][rows].sum(0).tolist() == [5, 5, 5]  # floor(0.55·10) = 5 dropped
        # Kept tokens are the most important ones of the shard, per KV head.
        for g in range(3):
            kept = importance[rows, g][keep[2][rows, g]]
            dropped = importance[rows, g][~keep[2][rows, g]]
            assert kept.min() > dropped.max()
    assert not (keep[2] & ~keep[1]).any()  # nested: level 3 keeps a subset of level 2
    ties = keep_masks(torch.ones(40, 1), layout, (0.0, 0.5, 0.5))
    assert ties[1][:10, 0].tolist() == [True] * 5 + [False] * 5  # later positions drop first


def test_corrected_drop_rule():
    assert level_drop_ratios(0.0) == (0.0, 0.0, 0.5)
    assert level_drop_ratios(0.2) == pytest.approx((0.0, 0.2, 0.6))
    assert level_drop_ratios(0.1, 0.3) == (0.0, 0.1, 0.3)


def test_merge_weights_are_the_levels_softmax_denominators():
    # Two one-token shards on two nodes: query 1 sees key 1 at level 1 and key 0 at level 3.
    # Scores (scale 1/√1): q1·k1 = ln 3 → z1 = 3; q1·k0 = 0 → z3 = 1. Eq. 5:
    # O = 3/4 · v1 + 1/4 · v0 = 3/4 · 8 + 1/4 · 4 = 7, lse = ln 4.
    q = torch.tensor([[[1.0]], [[1.0]]])
    k = torch.tensor([[[0.0]], [[math.log(3.0)]]])
    v = torch.tensor([[[4.0]], [[8.0]]])
    out, lse, _, parts = csa_attention(q, k, v, CsaLayout((0, 1, 2), 1), [])
    assert out[1, 0, 0].item() == pytest.approx(7.0, abs=1e-6)
    assert lse[0, 1].item() == pytest.approx(math.log(4.0), abs=1e-6)
    assert parts[0][1][0, 1].item() == pytest.approx(math.log(3.0), abs=1e-6)  # level 1
    assert math.isinf(parts[1][1][0, 1].item())  # no level-2 keys: weight 0
    assert parts[2][1][0, 1].item() == pytest.approx(0.0, abs=1e-6)  # level 3: z = 1
    assert out[0, 0, 0].item() == pytest.approx(4.0, abs=1e-6)  # query 0 sees only key 0


def test_nonzero_drop_changes_the_output_only_past_the_own_shard():
    q, k, v = _qkv(32)
    layout = CsaLayout.even(32, 4, 2)
    importance = torch.rand(32, 2, generator=torch.Generator().manual_seed(3))
    dense, _, _, _ = csa_attention(q, k, v, layout, [])
    out, _, _, parts = csa_attention(q, k, v, layout,
                                     keep_masks(importance, layout, level_drop_ratios(0.5)))
    assert (out - dense).abs().max() > 1e-2
    torch.testing.assert_close(out[:8], dense[:8])  # shard 0 has only level 1: untouched
    # A query dropped at level 3 gets no level-3 result.
    assert torch.isneginf(parts[2][1][:, 8:]).any()
    # Dropping only K and V: every query past node 0 keeps a level-3 result, and the output
    # differs from both dense attention and the paper's Q-dropping rule.
    kv_only, _, _, kv_parts = csa_attention(
        q, k, v, layout, keep_masks(importance, layout, level_drop_ratios(0.5)),
        drop_queries=False)
    assert torch.isfinite(kv_parts[2][1][:, 16:]).all()
    assert (kv_only - dense).abs().max() > 1e-2 and (kv_only - out).abs().max() > 1e-2


def _four_layer_tiny():
    cfg = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=4,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=256, seed=3)
    return load_model(cfg)[0]


@torch.inference_mode()
def test_csa_prefill_on_the_tiny_model_exact_at_zero_and_lossy_above():
    model = _four_layer_tiny()
    ids = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(48)
    dense = model.logits(model.forward(
        ids, pos, lambda i, q, k, v: attention_with_lse_ref(q, k, v, causal=True)[0]))
    layout = CsaLayout.even(48, 4, 2)
    with pytest.raises(ValueError):
        CsaPrefill(CsaConfig(), layout, 4)  # off by default
    zero = CsaPrefill(CsaConfig(enabled=True, level3_drop_ratio=0.0), layout, 4)
    torch.testing.assert_close(model.logits(model.forward(ids, pos, zero)), dense,
                               atol=1e-5, rtol=1e-5)
    assert zero.stats.moved_fraction_dropped() == 0.0
    lossy = CsaPrefill(CsaConfig(enabled=True, level2_drop_ratio=0.25), layout, 4)
    out = model.logits(model.forward(ids, pos, lossy))
    assert (out - dense).abs().max() > 1e-4
    # Layers 1 and 2 drop (not 0: no scores yet; not 3: the last). Per layer each of the 2
    # KV heads receives: level 2, shards 0→1 and 2→3 (12 rows each); level 3, shards 0,1→2,3.
    s = lossy.stats
    assert s.kv_rows_dense[1] == 4 * 2 * 2 * 12 and s.kv_rows_dense[2] == 4 * 4 * 2 * 12
    assert s.kv_rows_kept[1] == s.kv_rows_dense[1] - 2 * 2 * 2 * 3  # floor(.25·12) = 3
    assert s.kv_rows_kept[2] == s.kv_rows_dense[2] - 2 * 4 * 2 * 7  # p3 = .625: 7 of 12
    assert 0.0 < s.pairs_fraction_dropped() < 1.0


def test_csa_section_of_a_deployment_is_off_by_default_and_checked(tmp_path):
    base = (tmp_path / "d.toml")
    base.write_text('[model]\nname = "tiny"\n')
    assert load_deployment(str(base)).csa == CsaConfig(enabled=False)
    base.write_text('[model]\nname = "tiny"\n[csa]\nenabled = true\nlevel2_drop_ratio = 0.2\n')
    cfg = load_deployment(str(base)).csa
    assert cfg.enabled and level_drop_ratios(cfg.level2_drop_ratio) == pytest.approx(
        (0.0, 0.2, 0.6))
    base.write_text('[model]\nname = "tiny"\n[csa]\nlevel2_drop_ratio = 1.0\n')
    with pytest.raises(Exception, match="drop ratios"):
        load_deployment(str(base))
