"""The engine on CUDA gives transformers' greedy tokens on CUDA (fp32), eager and by CUDA-graph
replay, for the oracle checkpoints (issue #22). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_hf_checkpoint
from tetris.config import ModelConfig
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NEW_TOKENS = 48
TEXTS = ["Tetris", "fills the gaps in the pool", "a",
         "chunkwise dynamic sequence parallelism runs each chunk on its own group",
         "ring attention merges partial results by log-sum-exp"]
CHECKPOINTS = {"gqa": dict(seed=11), "mha-tied": dict(seed=5, num_key_value_heads=8,
                                                      tie_word_embeddings=True)}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def pair(request, tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), **CHECKPOINTS[request.param])
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ours = load_model(ModelConfig(source="hf", path=str(path), dtype="float32"), device="cuda")
    return hf, ours


@torch.inference_mode()
def _hf_greedy(hf, prompt):
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=NEW_TOKENS, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_on_cuda_matches_transformers_on_cuda(pair, graphs):
    hf, (model, tok) = pair
    assert model.device.type == "cuda"
    prompts = [tok.encode(t) for t in TEXTS]
    engine = LLMEngine(model, tok, num_blocks=128, block_size=16, max_num_seqs=8,
                       max_num_batched_tokens=64, cuda_graphs=graphs)
    assert engine.cache.buffer.is_cuda
    free = engine.num_free_blocks   # with graphs on, one block is the padded rows' scratch
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == _hf_greedy(hf, prompt), f"prompt of {len(prompt)} tokens"
    if graphs:
        assert engine.runner.graph_steps > 0
    assert engine.num_free_blocks == free
