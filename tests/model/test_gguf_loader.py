"""GGUF checkpoints: dequantisation against gguf's own reference, the metadata's config, the
q/k rotary rows, TP shards and the errors, on tiny files written by the tests."""

from __future__ import annotations

import os

import gguf
import msgspec
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gguf_helpers import (
    TINY,
    encode_tensor,
    gguf_name,
    layer_names,
    llama_cpp_permute,
    random_hf_weights,
    write_llama_gguf,
)
from tetris.config import ModelConfig
from tetris.kernels.attention import attention_with_lse
from tetris.model.gguf_quants import SUPPORTED, UnsupportedQuantization, dequantize
from tetris.model.gguf_reader import GGUFError
from tetris.model.llama import LlamaModel
from tetris.model.loader import load_model, resolve_model_config
from tetris.model.weights import load_tensor

REQUIRED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def _causal(i, q, k, v):
    return attention_with_lse(q, k, v, causal=True)[0]


def _logits(model: LlamaModel) -> torch.Tensor:
    ids = torch.arange(20) * 37 % model.cfg.vocab_size
    with torch.inference_mode():
        return model.logits(model(ids, torch.arange(20), _causal))


def _cfg(path, **kw) -> ModelConfig:
    return ModelConfig(source="gguf", path=str(path), **kw)


@pytest.mark.parametrize("kind", SUPPORTED)
def test_dequantize_matches_gguf_reference(kind):
    assert set(REQUIRED) <= set(SUPPORTED)
    x = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    raw, qtype = encode_tensor(x, kind, seed=1)
    want = gguf.quants.dequantize(raw, qtype).reshape(-1)
    got = dequantize(raw, kind, x.size)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    if kind in ("F32", "F16", "BF16", "Q8_0"):  # quantised here from x: close to it
        np.testing.assert_allclose(got, x.reshape(-1), atol=0.05 * np.abs(x).max())


def test_unsupported_type_names_type_and_tensor():
    raw = np.zeros(84, dtype=np.uint8)
    with pytest.raises(UnsupportedQuantization, match=r"blk\.0\.attn_q\.weight.*Q2_K"):
        dequantize(raw, "Q2_K", 256, what="blk.0.attn_q.weight")


def test_every_type_loads_as_the_file_dequantises(tmp_path):
    weights = random_hf_weights(TINY)
    names = [n for n in weights if weights[n].ndim == 2] + ["norm.weight"]
    types = {n: SUPPORTED[i % len(SUPPORTED)] for i, n in enumerate(names)}
    assert set(types.values()) == set(SUPPORTED)
    written = write_llama_gguf(tmp_path / "m.gguf", weights, types=types)
    for dtype in ("float32", "bfloat16"):
        model, _ = load_model(_cfg(tmp_path / "m.gguf", dtype=dtype))
        params = dict(model.named_parameters())
        for hf, shape in layer_names(TINY).items():
            raw, qtype = written[gguf_name(hf)]
            want = gguf.quants.dequantize(raw, qtype).reshape(shape)
            got = params[hf].float().numpy()
            # the model holds HF row order; the file holds llama.cpp's
            if "q_proj" in hf:
                got = llama_cpp_permute(got, TINY.num_heads)
            elif "k_proj" in hf:
                got = llama_cpp_permute(got, TINY.num_kv_heads)
            want = torch.from_numpy(want).to(getattr(torch, dtype)).float().numpy()
            np.testing.assert_array_equal(got, want, err_msg=f"{hf} ({qtype.name}, {dtype})")
        assert params["embed_tokens.weight"].dtype == getattr(torch, dtype)


def test_unsupported_type_in_a_file_names_it(tmp_path):
    weights = random_hf_weights(TINY)
    write_llama_gguf(tmp_path / "m.gguf", weights,
                     types={"layers.1.mlp.up_proj.weight": "Q2_K"})
    with pytest.raises(UnsupportedQuantization) as e:
        load_model(_cfg(tmp_path / "m.gguf"))
    assert "Q2_K" in str(e.value) and "blk.1.ffn_up.weight" in str(e.value)


def test_config_comes_from_the_metadata(tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", random_hf_weights(TINY))
    cfg = resolve_model_config(_cfg(tmp_path / "m.gguf", name="mine", dtype="bfloat16"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 256, 256)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.attention_head_dim) == (4, 2, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (264, 512)
    assert cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert (cfg.name, cfg.dtype, cfg.source) == ("mine", "bfloat16", "gguf")


def test_rotary_permutation_is_undone(tmp_path):
    """HF weights written the llama.cpp way come back as they were, with the HF model's logits
    (ours from the HF tensors, and transformers' from the same tensors)."""
    cfg = msgspec.structs.replace(TINY, tie_word_embeddings=False)
    weights = random_hf_weights(cfg, seed=7)
    write_llama_gguf(tmp_path / "m.gguf", weights, cfg)
    ours, _ = load_model(_cfg(tmp_path / "m.gguf"))
    assert not ours.cfg.tie_word_embeddings
    for name, p in ours.named_parameters():
        np.testing.assert_array_equal(p.numpy(), weights[name], err_msg=name)
    direct = LlamaModel(ours.cfg)
    for name, w in weights.items():
        load_tensor(direct, name, torch.from_numpy(w))
    got = _logits(ours)
    assert torch.equal(got, _logits(direct))

    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict({("lm_head.weight" if n == "lm_head.weight" else f"model.{n}"):
                        torch.from_numpy(w) for n, w in weights.items()})
    ids = torch.arange(20) * 37 % cfg.vocab_size
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_without_unpermuting_the_logits_differ(tmp_path, monkeypatch):
    """The check above has teeth: q and k loaded in the file's row order rotate the wrong
    pairs of dimensions."""
    write_llama_gguf(tmp_path / "m.gguf", random_hf_weights(TINY, seed=7))
    right = _logits(load_model(_cfg(tmp_path / "m.gguf"))[0])
    monkeypatch.setattr("tetris.model.gguf_weights.unpermute_rotary_rows", lambda w, heads: w)
    wrong = _logits(load_model(_cfg(tmp_path / "m.gguf"))[0])
    assert (right - wrong).abs().max() > 1e-2


def test_other_architectures_are_refused(tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", random_hf_weights(TINY), arch="qwen2")
    with pytest.raises(GGUFError, match="general.architecture is 'qwen2'; only 'llama'"):
        resolve_model_config(_cfg(tmp_path / "m.gguf"))


def test_mixture_of_experts_is_refused(tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", random_hf_weights(TINY),
                     extra={"llama.expert_count": 8})
    with pytest.raises(GGUFError, match="mixture-of-experts"):
        resolve_model_config(_cfg(tmp_path / "m.gguf"))


def _tp_worker(rank: int, store_path: str, path: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    try:
        model, _ = load_model(_cfg(path), tp_group=dist.group.WORLD)
        assert model.local_num_heads * 2 == model.cfg.num_heads
        torch.save(_logits(model), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_shards_give_the_tp1_logits(tmp_path):
    weights = random_hf_weights(TINY, seed=2)
    kinds = ("Q4_K", "Q6_K", "Q8_0", "Q4_1")
    types = {n: kinds[i % len(kinds)] for i, n in enumerate(weights) if weights[n].ndim == 2}
    path = str(tmp_path / "m.gguf")
    write_llama_gguf(tmp_path / "m.gguf", weights, types=types)
    mp.spawn(_tp_worker, args=(str(tmp_path / "store"), path, str(tmp_path)), nprocs=2)
    want = _logits(load_model(_cfg(path))[0])
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), want,
                                   atol=1e-5, rtol=1e-5)
