"""Dummy weights, config.json reading and loader errors."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from checkpoints import make_hf_checkpoint
from tetris.config import ModelConfig, RopeScaling
from tetris.kernels.attention import attention_with_lse
from tetris.model.hf_config import HFConfigError, model_config_from_hf
from tetris.model.loader import load_model
from tetris.model.weights import WeightsError

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, seed=0)


def _causal(i, q, k, v):
    return attention_with_lse(q, k, v, causal=True)[0]


def _greedy(model, ids, steps):
    ids = list(ids)
    for _ in range(steps):
        h = model(torch.tensor(ids), torch.arange(len(ids)), _causal)
        ids.append(int(model.logits(h[-1:]).argmax()))
    return ids


def test_dummy_weights_are_seeded_and_not_degenerate():
    a, tok = load_model(TINY)
    b, _ = load_model(TINY)
    c, _ = load_model(msgspec.structs.replace(TINY, seed=1))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers[0].self_attn.q_proj.weight, c.layers[0].self_attn.q_proj.weight)
    assert a.cfg.bos_token_id == tok.bos_token_id and a.cfg.eos_token_ids == tok.eos_token_ids
    prompt = tok.encode("The quick brown fox")
    out = _greedy(a, prompt, 12)[len(prompt):]
    assert len(set(out)) >= 4, out  # greedy text does not collapse onto one token
    assert out[0] != out[1] or out[1] != out[2]
    logits = a.logits(a(torch.tensor(prompt), torch.arange(len(prompt)), _causal))
    assert torch.isfinite(logits).all() and 0.05 < logits.std() < 10


def test_config_json_old_style_rope_scaling(tmp_path):
    raw = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "bos_token_id": 1, "eos_token_id": [2, 3],
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = model_config_from_hf(tmp_path, ModelConfig(source="hf", path=str(tmp_path),
                                                     dtype="bfloat16"))
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.attention_head_dim) == (3, 8, 4, 8)
    assert cfg.rope_theta == 500000.0 and cfg.tie_word_embeddings and cfg.dtype == "bfloat16"
    assert cfg.rope_scaling == RopeScaling(factor=32.0, original_max_position_embeddings=8192)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 3)


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "unsupported architecture"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope_type"),
    ({"hidden_act": "gelu"}, "only silu"),
    ({"num_key_value_heads": 3}, "multiple of"),
], ids=["arch", "rope", "act", "gqa"])
def test_config_json_rejections(tmp_path, change, match):
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
           "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
           "num_attention_heads": 8, "num_key_value_heads": 2, **change}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises((HFConfigError, ValueError), match=match):
        model_config_from_hf(tmp_path)


def test_missing_or_invalid_directories(tmp_path):
    with pytest.raises(HFConfigError, match="does not exist"):
        load_model(ModelConfig(source="hf", path=str(tmp_path / "nope")))
    with pytest.raises(HFConfigError, match="no config.json"):
        load_model(ModelConfig(source="hf", path=str(tmp_path)))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFConfigError, match="not valid JSON"):
        load_model(ModelConfig(source="hf", path=str(tmp_path)))


def test_incomplete_or_mismatched_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_hf_checkpoint(tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(WeightsError, match="lacks 1 tensors: layers.1.mlp.down_proj.weight"):
        load_model(ModelConfig(source="hf", path=str(path)))
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(WeightsError, match="down_proj.weight.*shape"):
        load_model(ModelConfig(source="hf", path=str(path)))
    (path / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no safetensors weights"):
        load_model(ModelConfig(source="hf", path=str(path)))
