"""Tiny Hugging Face Llama checkpoints built on the fly, for oracle tests (no download).

``make_hf_checkpoint(tmp_path, **overrides)`` writes a seeded random fp32
``transformers.LlamaForCausalLM`` with safetensors weights (sharded when ``max_shard_size``
is given), a byte-level ``tokenizer.json`` and a ``tokenizer_config.json``, and returns the
directory. ``overrides`` are LlamaConfig fields (e.g. ``num_key_value_heads=1``,
``tie_word_embeddings=True``, ``rope_parameters={...}``).

Tokenizer: byte-level BPE with no merges, so every UTF-8 byte is one token (ids 0-255),
then the specials below from id 256; the model's vocab must hold them (vocab_size >= 261).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
BOS_ID = 256
EOS_IDS = (257, 260)

DEFAULT_LLAMA = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def _write_tokenizer(out: Path, chat_template: str | None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1]}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _byte_of(char: str) -> int:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256+n.
    table = _bytes_to_unicode()
    return {v: k for k, v in table.items()}[char]


def _bytes_to_unicode() -> dict[int, str]:
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def make_hf_checkpoint(tmp_path: Path, *, seed: int = 0, max_shard_size: str | None = None,
                       chat_template: str | None = None, name: str = "hf-llama",
                       **llama_config_overrides) -> Path:
    """Build and save a tiny random LlamaForCausalLM; returns its directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    params = {**DEFAULT_LLAMA, **llama_config_overrides}
    if params["vocab_size"] < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for the byte tokenizer")
    if "rope_parameters" in params:
        params.pop("rope_theta")
    params.setdefault("bos_token_id", BOS_ID)
    params.setdefault("eos_token_id", list(EOS_IDS))
    out = Path(tmp_path) / name
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**params)).float().eval()
    # HF's default init (std 0.02, norms 1) gives near-constant logits; perturb the norms so
    # the oracle also checks that every norm weight is loaded where it belongs.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    _write_tokenizer(out, chat_template)
    return out
