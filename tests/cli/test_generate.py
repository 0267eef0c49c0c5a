"""``tetris generate``: prints only the completion, matches the engine and transformers, and
turns bad input into ``error: ...`` with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import make_hf_checkpoint
from tetris.cli.main import main
from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
TINY_CPU = str(REPO / "configs" / "tiny-cpu.toml")


def _cli(capsys, *argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_config_prints_the_engines_greedy_completion_only(capsys):
    code, out, err = _cli(capsys, "--config", TINY_CPU, "--prompt", "hi", "--max-tokens", "16",
                          "--temperature", "0")
    assert code == 0 and err == ""
    model, tok = load_model(load_deployment(TINY_CPU).model)
    engine = LLMEngine(model, tok, num_blocks=8, block_size=16)
    expected = engine.generate([tok.encode("hi")],
                               SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out == expected.text + "\n"


def test_json_seed_and_prompt_file(capsys, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Tetris fills the gaps")
    args = ("--config", TINY_CPU, "--prompt-file", str(prompt), "--max-tokens", "8",
            "--temperature", "0.8", "--seed", "5", "--ignore-eos", "--json")
    code, out, _ = _cli(capsys, *args)
    first = json.loads(out)
    assert code == 0 and len(first["token_ids"]) == 8 and first["finish_reason"] == "length"
    assert first["prompt_tokens"] == len("Tetris fills the gaps") + 1  # bytes plus BOS
    assert json.loads(_cli(capsys, *args)[1]) == first
    other = json.loads(_cli(capsys, *args[:-3], "6", "--ignore-eos", "--json")[1])
    assert other["token_ids"] != first["token_ids"]


def test_model_dir_matches_transformers_generate(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt = make_hf_checkpoint(tmp_path, seed=4)
    code, out, _ = _cli(capsys, "--model", str(ckpt), "--prompt", "abc", "--max-tokens", "12",
                        "--temperature", "0", "--ignore-eos", "--json")
    assert code == 0
    ours = json.loads(out)
    hf = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([[256, *b"abc"]])  # BOS then the bytes
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=12)[0, 4:].tolist()
    assert ours["token_ids"] == ref


def test_chat_template_wraps_the_prompt(capsys):
    code, out, _ = _cli(capsys, "--config", TINY_CPU, "--prompt", "hi", "--max-tokens", "4",
                        "--temperature", "0", "--ignore-eos", "--chat", "--json")
    chat = json.loads(out)
    code2, out2, _ = _cli(capsys, "--config", TINY_CPU, "--prompt", "hi", "--max-tokens", "4",
                          "--temperature", "0", "--ignore-eos", "--json")
    plain = json.loads(out2)
    assert code == code2 == 0
    assert chat["prompt_tokens"] > plain["prompt_tokens"] + 10  # headers around "hi"


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "", "--max-tokens", "4"], "prompt is empty"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be"),
    (["--prompt", "hi", "--top-p", "0"], "top_p must be"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens must be"),
])
def test_bad_input_exits_2_with_error_line(capsys, argv, message):
    code, out, err = _cli(capsys, "--config", TINY_CPU, *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_malformed_config_and_missing_model(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nhidden_size = "big"\n')
    code, _, err = _cli(capsys, "--config", str(bad), "--prompt", "hi")
    assert code == 2 and err.startswith("error: ") and "model.hidden_size" in err
    code, _, err = _cli(capsys, "--model", str(tmp_path / "nothing"), "--prompt", "hi")
    assert code == 2 and "no config.json" in err


def test_prompt_longer_than_context_in_a_real_process(tmp_path):
    cfg = tmp_path / "short.toml"
    cfg.write_text(Path(TINY_CPU).read_text().replace("max_position_embeddings = 32768",
                                                      "max_position_embeddings = 16"))
    proc = subprocess.run(
        [sys.executable, "-m", "tetris.cli.main", "generate", "--config", str(cfg),
         "--prompt", "x" * 40, "--max-tokens", "4"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "error: prompt has 41 tokens but the model's context is 16 tokens "
        "(max_position_embeddings)")
