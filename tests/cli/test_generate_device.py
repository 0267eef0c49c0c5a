"""``tetris generate`` runs its engine where ``--device`` or the config's ``model.device`` says:
asked for CUDA on a machine without it, it fails at start naming CUDA; ``--device`` overrides
the file (docs/gpu.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tetris.cli.generate import cli_device
from tetris.cli.main import main
from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

TINY_CPU = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
ARGS = ("--prompt", "hi", "--max-tokens", "6", "--temperature", "0")


def _cuda_config(tmp_path) -> str:
    text = TINY_CPU.read_text().replace('[model]\n', '[model]\ndevice = "cuda"\n', 1)
    path = tmp_path / "tiny-cuda.toml"
    path.write_text(text)
    assert load_deployment(str(path)).model.device == "cuda"
    return str(path)


def _cli(capsys, *argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@NO_CUDA
def test_device_flag_cuda_without_cuda_fails_naming_cuda(capsys):
    code, out, err = _cli(capsys, "--config", str(TINY_CPU), "--device", "cuda", *ARGS)
    assert (code, out) == (2, "")
    assert err.startswith("error: model.device = 'cuda' but CUDA is not available")


@NO_CUDA
def test_config_device_cuda_without_cuda_fails_and_the_flag_overrides_it(capsys, tmp_path):
    config = _cuda_config(tmp_path)
    code, out, err = _cli(capsys, "--config", config, *ARGS)
    assert code == 2 and "CUDA is not available" in err
    code, out, err = _cli(capsys, "--config", config, "--device", "cpu", *ARGS)
    assert code == 0 and err == ""
    model, tok = load_model(load_deployment(str(TINY_CPU)).model)
    assert model.device.type == "cpu"
    want = LLMEngine(model, tok, num_blocks=8, block_size=16).generate(
        [tok.encode("hi")], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out == want.text + "\n"


def test_cli_device_on_its_inputs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [cli_device(d) for d in ("auto", "cpu")] == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # outside Ray the process owns the GPUs it sees: auto takes one
    assert [cli_device(d) for d in ("auto", "cuda", "cpu")] == ["cuda", "cuda", "cpu"]
