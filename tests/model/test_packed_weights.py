"""oneDNN-packed GEMM weights: the same results as F.linear up to float rounding, stale copies
are never used, and an engine with packed weights samples the same greedy tokens."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from model_helpers import CFG, logits_of

from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.model.packed import PackedWeight, can_pack, linear
from tetris.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(2, 2)), reason="no oneDNN packing")


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_packed_linear_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 24, generator=gen)
    x = torch.randn(rows, 24, generator=gen)
    packed = PackedWeight(w, batch_hint=32)
    got = packed(x)
    assert got.shape == (rows, 40)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
    # A non-contiguous input (the o_proj input is a reshaped attention output) works too.
    xt = torch.randn(24, rows, generator=gen).t()
    torch.testing.assert_close(packed(xt), F.linear(xt, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_packed_bf16_linear_matches_f_linear_within_one_rounding(rows):
    """bf16 operands, fp32 accumulation, one rounding of each output to bf16: both paths sit
    within bf16's unit roundoff (2^-8, relative) of the exact product, so within two of
    each other. K = 96 terms of fp32 summation add nothing visible at that scale."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 96, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    got = PackedWeight(w, batch_hint=32)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    exact = x.double() @ w.double().t()
    unit = 2.0 ** -8
    assert bool(((got.double() - exact).abs() <= unit * exact.abs() + 1e-6).all())
    ref = F.linear(x, w).double()
    assert bool(((got.double() - ref).abs() <= 2 * unit * exact.abs() + 1e-6).all())
    with pytest.raises(ValueError, match="dtype"):
        PackedWeight(w, batch_hint=32)(x.float())  # mixing dtypes is refused, not cast


def test_stale_copy_falls_back_to_the_current_weight():
    w = torch.randn(8, 4)
    x = torch.randn(3, 4)
    packed = PackedWeight(w, batch_hint=4)
    assert packed.fresh_for(w)
    w.mul_(2.0)  # in place: the copy now holds the old values
    assert not packed.fresh_for(w)
    torch.testing.assert_close(linear(x, w, packed), F.linear(x, w))
    other = w.clone()  # equal values, another tensor: not the copy's source
    assert not packed.fresh_for(other)


def test_write_through_a_view_makes_the_fused_copy_stale():
    model, _ = load_model(CFG)
    assert model.pack_weights(batch_hint=4) == 4 * CFG.num_layers + 1
    qkv = model.layers[0].self_attn.qkv
    assert qkv.packed.fresh_for(qkv.weight)
    with torch.no_grad():  # what a weight load does: copy into the member's view
        model.layers[0].self_attn.k_proj.weight.add_(1.0)
    assert not qkv.packed.fresh_for(qkv.weight)
    unpacked, _ = load_model(CFG)
    with torch.no_grad():
        unpacked.layers[0].self_attn.k_proj.weight.add_(1.0)
    torch.testing.assert_close(logits_of(model), logits_of(unpacked), atol=1e-4, rtol=1e-4)
    assert model.pack_weights(batch_hint=4) == 1  # only the stale copy is remade


def test_packed_model_logits_match_unpacked():
    model, _ = load_model(CFG)
    before = logits_of(model)
    model.pack_weights()
    assert model.head_packed is not None and model.layers[1].mlp.down_proj.packed is not None
    after = logits_of(model)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    model.unpack_weights()
    assert torch.equal(logits_of(model), before)


def test_packed_model_survives_pickle_and_deepcopy():
    model, _ = load_model(CFG)
    model.pack_weights()
    want = logits_of(model)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        # The copies are rebuilt from their sources on the other side, still fresh.
        down = clone.layers[0].mlp.down_proj
        assert down.packed.fresh_for(down.weight) and down.packed.packed.is_mkldnn
        assert clone.head_packed.fresh_for(clone.lm_head.weight)
        torch.testing.assert_close(logits_of(clone), want, atol=1e-4, rtol=1e-4)


def test_engine_packs_by_default_on_cpu_and_greedy_tokens_match():
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 200, 17], [42] * 9, list(range(30, 50))]
    results = {}
    for packed in (False, True):
        model, _ = load_model(CFG)
        engine = LLMEngine(model, None, num_blocks=32, block_size=4, max_num_seqs=4,
                           packed_weights=None if packed else False)
        assert (model.head_packed is not None) == packed
        results[packed] = [list(o.token_ids) for o in engine.generate(prompts, params)]
    assert results[True] == results[False]
    assert all(len(t) == 24 for t in results[True])
