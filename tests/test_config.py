"""Deployment configs: the embedded default loads; bad files fail naming file, key and expectation."""

from __future__ import annotations

import pytest

from tetris.config import ConfigError, DeploymentConfig, default_deployment_path, load_deployment


def _write(tmp_path, text: str):
    p = tmp_path / "deploy.toml"
    p.write_text(text)
    return p


def test_embedded_default_is_the_tiny_cpu_deployment():
    cfg = load_deployment()
    assert isinstance(cfg, DeploymentConfig)
    assert cfg.source_path == str(default_deployment_path())
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_heads, cfg.model.num_kv_heads) == (4, 256, 8, 2)
    assert cfg.model.max_position_embeddings == 32768
    assert (cfg.prefill.num_instances, cfg.prefill.tp_size, cfg.prefill.node_size) == (4, 1, 2)
    assert (cfg.decode.num_instances, cfg.decode.tp_size) == (1, 2)
    assert cfg.model.attention_head_dim == 32


def test_loading_by_embedded_name_and_by_path_agree():
    by_name = load_deployment("tiny-cpu.toml")
    by_path = load_deployment(default_deployment_path())
    assert by_name == by_path


def test_unknown_key_names_file_and_full_key(tmp_path):
    p = _write(tmp_path, "[model]\nhidden_sizee = 3\n")
    with pytest.raises(ConfigError) as e:
        load_deployment(p)
    assert str(p) in str(e.value) and "model.hidden_sizee" in str(e.value)


def test_wrong_type_names_key_and_expected_type(tmp_path):
    p = _write(tmp_path, '[model]\n[prefill]\nnum_instances = "four"\n')
    with pytest.raises(ConfigError) as e:
        load_deployment(p)
    msg = str(e.value)
    assert "prefill.num_instances" in msg and "int" in msg and str(p) in msg


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("[model]\nnum_heads = 7\n", "multiple of model.num_kv_heads"),
        ("[model]\nsource = 'hf'\n", "model.path is required"),
        ("[model]\n[prefill]\nnum_instances = 5\nnode_size = 2\n", "multiple of prefill.node_size"),
        ("[model]\n[scheduler]\nimprovement_rate = 1.5\n", "improvement_rate"),
        ("[model]\n[scheduler]\nsp_candidates = [1, 3]\n", "powers of two"),
        ("[model]\ndtype = 'float8'\n", "model.dtype"),
    ],
)
def test_bad_values_are_explained(tmp_path, body, fragment):
    with pytest.raises(ConfigError) as e:
        load_deployment(_write(tmp_path, body))
    assert fragment in str(e.value)


def test_malformed_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_deployment(_write(tmp_path, "[model\n"))
    with pytest.raises(ConfigError, match="no such deployment file"):
        load_deployment(tmp_path / "absent.toml")


def test_relative_model_path_resolves_against_the_config_folder(tmp_path):
    (tmp_path / "ckpt").mkdir()
    cfg = load_deployment(_write(tmp_path, "[model]\nsource = 'hf'\npath = 'ckpt'\n"))
    assert cfg.model.path == str((tmp_path / "ckpt").resolve())
