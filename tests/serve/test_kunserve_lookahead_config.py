"""``[kunserve] lookahead``: off by default, validated, and what a group's members get from it
(the served members' micro-batches themselves: tests/actors/decode/test_kunserve_served.py)."""

from __future__ import annotations

import pytest
from tetris.actors.decode.rank_kunserve import _lookahead

from tetris.config import ConfigError, ModelConfig, load_deployment
from tetris.engine.engine import LLMEngine
from tetris.engine.pipeline import layer_bytes
from tetris.model.loader import load_model


def _load(tmp_path, table: str):
    p = tmp_path / "deploy.toml"
    p.write_text(f"[model]\n[kunserve]\nenabled = true\n{table}")
    return load_deployment(p)


def test_lookahead_is_off_by_default_and_its_load_per_micro_batch_is_validated(tmp_path):
    assert _load(tmp_path, "").kunserve.member_lookahead() is None
    on = _load(tmp_path, "lookahead = true\nlookahead_overhead_seqs = 2.5\n").kunserve
    assert on.member_lookahead() == 2.5
    assert _load(tmp_path, "lookahead_overhead_seqs = 2.5\n").kunserve.member_lookahead() is None
    for bad in ("-1.0", "inf"):
        with pytest.raises(ConfigError, match="lookahead_overhead_seqs"):
            _load(tmp_path, f"lookahead = true\nlookahead_overhead_seqs = {bad}\n")


def test_a_member_gets_eq_1_2_of_its_own_model_or_nothing():
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=384, num_layers=4,
                      num_heads=4, num_kv_heads=2, seed=5)
    model, tok = load_model(cfg)
    engine = LLMEngine(model, tok, num_blocks=8, block_size=4)
    assert _lookahead(engine, None) is None
    plan = _lookahead(engine, 3.0)
    params = layer_bytes(model.layers[0]) // model.dtype.itemsize
    assert plan.cost.alpha == 2.0 * 64 / params and plan.cost.gamma == 1.0
    assert plan.cost.epsilon == plan.cost.delta == 3.0 and plan.balanced and plan.count is None
