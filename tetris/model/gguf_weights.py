"""Filling a LlamaModel from a GGUF file: dequantised tensors under their HF names.

Each GGUF tensor is dequantised (``gguf_quants``) to a full float32 tensor, renamed to the
HF name and handed to ``weights.load_tensor``, which casts it to the model's dtype and keeps
this rank's TP shard: the TP path is the same one HF checkpoints take.

llama.cpp's converter reorders the rows of ``attn_q`` and ``attn_k`` within every head so
that its rotary kernel can rotate adjacent pairs (x[2i], x[2i+1]); our rotary
(``layers.RotaryEmbedding``) rotates the halves (x[i], x[i + D/2]) as HF checkpoints do.
Within a head of D rows the file holds HF row ``j * D/2 + i`` at row ``2i + j``
(i < D/2, j < 2); ``unpermute_rotary_rows`` puts them back.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from tetris.config import ModelConfig
from tetris.model.gguf_quants import dequantize
from tetris.model.gguf_reader import GGUFFile
from tetris.model.llama import LlamaModel
from tetris.model.weights import WeightsError, expected_names, load_tensor

__all__ = ["hf_name", "unpermute_rotary_rows", "iter_gguf_tensors", "load_gguf_weights"]

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    """GGUF tensor name -> HF name without ``model.`` (``blk.3.attn_q.weight`` ->
    ``layers.3.self_attn.q_proj.weight``); WeightsError for a tensor Llama has no place for."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit()
            and parts[2] in _LAYER_NAMES and parts[3] == "weight"):
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    raise WeightsError(f"GGUF tensor {name!r} has no place in a Llama model")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order of a q or k projection [heads * D, in]."""
    rows, cols = weight.shape
    if rows % (2 * num_heads):
        raise WeightsError(f"{rows} rows do not split into {num_heads} heads of even size")
    d = rows // num_heads
    return weight.reshape(num_heads, d // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _full_tensor(gf: GGUFFile, name: str) -> np.ndarray:
    """The GGUF tensor ``name`` dequantised to float32 in HF shape (ggml lists dims innermost
    first, so the HF shape is the reverse)."""
    t = gf.tensors[name]
    shape = tuple(int(n) for n in reversed(t.shape))
    flat = dequantize(t.data, t.tensor_type.name, int(t.n_elements),
                      what=f"{gf.path}: tensor {name}")
    return flat.reshape(shape)


def iter_gguf_tensors(gf: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full float32 tensor) for every tensor of ``gf``, in file order, with the q
    and k rows in HF order."""
    for name in gf.tensors:
        target = hf_name(name)
        full = _full_tensor(gf, name)
        if target.endswith("self_attn.q_proj.weight"):
            full = unpermute_rotary_rows(full, cfg.num_heads)
        elif target.endswith("self_attn.k_proj.weight"):
            full = unpermute_rotary_rows(full, cfg.num_kv_heads)
        yield target, torch.from_numpy(np.ascontiguousarray(full))


def load_gguf_weights(model: LlamaModel, gf: GGUFFile) -> None:
    """Load every tensor of ``gf`` into ``model`` (this rank's shards, the model's dtype);
    every parameter must be set."""
    loaded: set[str] = set()
    for name, tensor in iter_gguf_tensors(gf, model.cfg):
        load_tensor(model, name, tensor)
        loaded.add(name)
    missing = [n for n in expected_names(model) if n not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise WeightsError(f"{gf.path}: the file lacks {len(missing)} tensors: {shown}")
