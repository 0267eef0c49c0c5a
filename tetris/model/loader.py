"""``load_model``: a ready LlamaModel and its tokenizer from a ModelConfig.

    source = "dummy"  seeded weights (``cfg.seed``) and a ByteTokenizer over cfg.vocab_size
    source = "hf"     config.json, safetensors (single or sharded) and tokenizer.json read
                      from the local directory ``cfg.path``; cfg.dtype still decides the dtype

With ``tp_group`` every rank builds only its shards; the caller must call this on all ranks.
The returned model's ``cfg`` is the resolved config (for HF: the architecture of the files).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from tetris.config import ModelConfig
from tetris.model.hf_config import model_config_from_hf
from tetris.model.llama import LlamaModel
from tetris.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tetris.model.weights import init_dummy_weights, load_hf_weights

__all__ = ["load_model", "resolve_model_config"]


def resolve_model_config(cfg: ModelConfig) -> ModelConfig:
    """The full architecture: ``cfg`` itself for dummy models, config.json merged in for HF.
    Dummy models get the ByteTokenizer's BOS/EOS ids unless the config sets them."""
    if cfg.source == "hf":
        return model_config_from_hf(Path(cfg.path), cfg)
    tok = ByteTokenizer(cfg.vocab_size)
    return msgspec.structs.replace(
        cfg,
        bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None else tok.bos_token_id,
        eos_token_ids=cfg.eos_token_ids or tok.eos_token_ids,
    )


def load_model(cfg: ModelConfig, *, tp_group=None, device="cpu") -> tuple[LlamaModel, Tokenizer]:
    resolved = resolve_model_config(cfg)
    model = LlamaModel(resolved, tp_group=tp_group, device=device)
    if resolved.source == "hf":
        load_hf_weights(model, resolved.path)
        tokenizer: Tokenizer = HFTokenizer(
            resolved.path, bos_token_id=resolved.bos_token_id,
            eos_token_ids=resolved.eos_token_ids,
        )
    else:
        init_dummy_weights(model, resolved.seed)
        tokenizer = ByteTokenizer(resolved.vocab_size)
    model.eval()
    return model, tokenizer
