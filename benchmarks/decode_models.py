"""The models and timers ``bench_decode.py`` compares: a seeded random Llama checkpoint in HF
format, loaded by transformers and by Tetris's engine, and per-step clock stamps of decoding
the same prompts greedily with each (transformers: a pass-through logits processor stamps every
forward pass; the engine: the clock after every step)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

# Named model shapes; any of --hidden/--intermediate/--layers/--heads/--kv-heads/--vocab
# overrides the chosen shape's value.
SHAPES = {
    "small": dict(hidden=768, intermediate=2048, layers=6, heads=12, kv_heads=4, vocab=32000),
    "tiny": dict(hidden=256, intermediate=688, layers=4, heads=8, kv_heads=2, vocab=512),
    # Llama-3.2-1B and Llama-3-8B geometry (random weights), for the GPU benchmark
    "llama-1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                     vocab=128256),
    "llama-8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                     vocab=128256),
}

# Engine options that turn its CPU decode speed-ups off: the "before" of --baseline.
ENGINE_BASELINE = dict(packed_weights=False)

BASE_MODEL = dict(max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def model_config(args) -> dict:
    return dict(BASE_MODEL, vocab_size=args.vocab, hidden_size=args.hidden,
                intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_checkpoint(out: Path, config: dict, seed: int, dtype: str = "float32",
                     device: str = "cpu") -> Path:
    """A seeded random checkpoint saved in ``dtype`` (initialised in fp32 on ``device``, then
    rounded; a GPU initialises a billion-parameter model in a moment)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config)).float().eval().to(DTYPES[dtype])
    model.save_pretrained(out, safe_serialization=True)
    return out


def load_ours(path: Path, dtype: str = "float32", device: str = "cpu"):
    from tetris.config import ModelConfig
    from tetris.model.hf_config import model_config_from_hf
    from tetris.model.llama import LlamaModel
    from tetris.model.weights import load_hf_weights

    cfg = model_config_from_hf(path, ModelConfig(source="hf", path=str(path), dtype=dtype))
    model = LlamaModel(cfg, device=device)
    load_hf_weights(model, path)
    return model.eval()


def load_hf(path: Path, dtype: str = "float32", device: str = "cpu"):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class _Stamps:
    """A logits processor that only records when it is called: once per forward pass."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(self.clock())
        return scores


def time_hf(model, prompts: torch.Tensor, new_tokens: int,
            clock=time.perf_counter) -> tuple[float, list[list[int]]]:
    """Seconds from the first token's logits to the last one's, and the new tokens."""
    stamps, tokens = stamps_hf(model, prompts, new_tokens, clock)
    return stamps[-1] - stamps[0], tokens


def stamps_hf(model, prompts: torch.Tensor, new_tokens: int,
              clock=time.perf_counter) -> tuple[list[float], list[list[int]]]:
    """The clock at every forward pass's logits (one per new token), and the new tokens."""
    from transformers import LogitsProcessorList

    stamps = _Stamps(clock)
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             logits_processor=LogitsProcessorList([stamps]))
    return stamps.times, out[:, prompts.shape[1]:].tolist()


def time_ours(model, prompts: torch.Tensor, new_tokens: int, clock=time.perf_counter,
              engine_options: dict | None = None) -> tuple[float, list[list[int]]]:
    """Seconds from the step that samples the first tokens to the one sampling the last."""
    stamps, tokens = stamps_ours(model, prompts, new_tokens, clock, engine_options)
    return stamps[-1] - stamps[0], tokens


def stamps_ours(model, prompts: torch.Tensor, new_tokens: int, clock=time.perf_counter,
                engine_options: dict | None = None) -> tuple[list[float], list[list[int]]]:
    """The clock after every engine step (the first one samples every first token)."""
    from tetris.engine.engine import LLMEngine
    from tetris.sampling_params import SamplingParams

    b, length = prompts.shape
    block_size = 16
    # one spare block: with CUDA graphs on, the engine keeps one as the padded rows' scratch
    blocks = b * -(-(length + new_tokens + 1) // block_size) + 1
    # The token budget holds every prompt, so all first tokens come from one step.
    engine = LLMEngine(model, None, num_blocks=blocks, block_size=block_size, max_num_seqs=b,
                       max_num_batched_tokens=b * length, **(engine_options or {}))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(b)}
    stamps = []
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            stamps.append(clock())
    return stamps, [tokens[str(i)] for i in range(b)]
