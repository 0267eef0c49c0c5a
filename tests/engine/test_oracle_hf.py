"""Oracle: the engine's greedy continuations equal transformers' LlamaForCausalLM.generate.

Each transformers reference runs one prompt at a time (no padding); the engine runs the same
prompts alone and all together in one paged batch. fp32, 64 new tokens, EOS not stopping.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_hf_checkpoint
from tetris.config import ModelConfig
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 64
TEXTS = ["Tetris", "fills the gaps in the pool", "a", "chunkwise dynamic sequence parallelism "
         "runs each chunk on its own group", "KV blocks", "ring attention merges partial "
         "results by log-sum-exp, layer by layer, while the MLP runs"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("oracle"), seed=11)


@pytest.fixture(scope="module")
def hf_greedy(checkpoint):
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run the full 64 tokens, like ignore_eos
    model.generation_config.pad_token_id = 0

    @torch.inference_mode()
    def run(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=0)
        return out[0, len(prompt):].tolist()

    return run


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_model(ModelConfig(source="hf", path=str(checkpoint)))


def test_single_prompt_matches_transformers(ours, hf_greedy):
    model, tok = ours
    prompt = tok.encode(TEXTS[1])
    engine = LLMEngine(model, tok, num_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    expected = hf_greedy(prompt)
    assert len(expected) == NEW_TOKENS
    assert list(out.token_ids) == expected


def test_mixed_length_batch_matches_transformers_one_by_one(ours, hf_greedy):
    model, tok = ours
    prompts = [tok.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    # A token budget below the longest prompt also chunks it while others decode.
    engine = LLMEngine(model, tok, num_blocks=128, block_size=8, max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == hf_greedy(prompt), f"prompt of {len(prompt)} tokens"
    assert engine.num_free_blocks == 128
