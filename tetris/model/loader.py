"""``load_model``: a ready LlamaModel and its tokenizer from a ModelConfig.

    source = "dummy"  seeded weights (``cfg.seed``) and a ByteTokenizer over cfg.vocab_size
    source = "hf"     config.json, safetensors (single or sharded) and tokenizer.json read
                      from the local directory ``cfg.path``; cfg.dtype still decides the dtype
    source = "gguf"   architecture, weights (dequantised to cfg.dtype) and tokenizer read from
                      the GGUF file ``cfg.path`` (a path or ``pkg:<distribution>/<file>``)

With ``tp_group`` every rank builds only its shards; the caller must call this on all ranks.
The returned model's ``cfg`` is the resolved config (for HF and GGUF: the architecture of the
files).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from tetris.config import ModelConfig
from tetris.model.hf_config import model_config_from_hf
from tetris.model.llama import LlamaModel
from tetris.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tetris.model.weights import init_dummy_weights, load_hf_weights

__all__ = ["load_model", "load_tokenizer_for", "model_config_for_path", "resolve_model_config"]


def model_config_for_path(path: str) -> ModelConfig:
    """The ModelConfig of a checkpoint named on the command line: a ``.gguf`` file or a
    ``pkg:`` spec is GGUF, anything else an HF directory."""
    if path.startswith("pkg:") or path.endswith(".gguf"):
        return ModelConfig(source="gguf", path=path)
    if not Path(path, "config.json").is_file():
        raise ValueError(f"{path}: neither a .gguf file nor a Hugging Face model directory "
                         "(no config.json)")
    return ModelConfig(source="hf", path=path)


def resolve_model_config(cfg: ModelConfig) -> ModelConfig:
    """The full architecture: ``cfg`` itself for dummy models, config.json or the GGUF metadata
    merged in for checkpoints. Dummy models get the ByteTokenizer's BOS/EOS ids unless the
    config sets them."""
    if cfg.source == "hf":
        return model_config_from_hf(Path(cfg.path), cfg)
    if cfg.source == "gguf":
        from tetris.model.gguf_reader import model_config_from_gguf, open_gguf

        return model_config_from_gguf(open_gguf(cfg.path), cfg)
    tok = ByteTokenizer(cfg.vocab_size)
    return msgspec.structs.replace(
        cfg,
        bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None else tok.bos_token_id,
        eos_token_ids=cfg.eos_token_ids or tok.eos_token_ids,
    )


def load_tokenizer_for(resolved: ModelConfig) -> Tokenizer:
    """The tokenizer of a resolved config, without loading weights (what an ingress needs)."""
    if resolved.source == "hf":
        return HFTokenizer(resolved.path, bos_token_id=resolved.bos_token_id,
                           eos_token_ids=resolved.eos_token_ids)
    if resolved.source == "gguf":
        from tetris.model.gguf_reader import open_gguf
        from tetris.model.gguf_tokenizer import GGUFTokenizer

        return GGUFTokenizer(open_gguf(resolved.path), bos_token_id=resolved.bos_token_id,
                             eos_token_ids=resolved.eos_token_ids)
    return ByteTokenizer(resolved.vocab_size)


def load_model(cfg: ModelConfig, *, tp_group=None, device="cpu") -> tuple[LlamaModel, Tokenizer]:
    resolved = resolve_model_config(cfg)
    model = LlamaModel(resolved, tp_group=tp_group, device=device)
    if resolved.source == "hf":
        load_hf_weights(model, resolved.path)
    elif resolved.source == "gguf":
        from tetris.model.gguf_reader import open_gguf
        from tetris.model.gguf_weights import load_gguf_weights

        load_gguf_weights(model, open_gguf(resolved.path))
    else:
        init_dummy_weights(model, resolved.seed)
    model.eval()
    return model, load_tokenizer_for(resolved)
