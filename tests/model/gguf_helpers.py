"""Writing tiny Llama GGUF files for the loader tests, the way llama.cpp's converter lays
them out (q/k rows permuted for its rotary, ggml names, tokenizer metadata)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from tetris.config import ModelConfig

# Quantised rows need a multiple of 256 values (the K formats' super-block).
TINY = ModelConfig(source="gguf", path="unused", vocab_size=264, hidden_size=256,
                   intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                   max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=True)

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Offsets of the f16 scale fields in one block: random bytes there could be NaN or inf.
_F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82)}


def layer_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape of every tensor of ``cfg`` (tied: no lm_head)."""
    d = cfg.hidden_size // cfg.num_heads
    shapes = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
              "norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (cfg.hidden_size,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * d, cfg.hidden_size),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, cfg.hidden_size),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, cfg.hidden_size),
            p + "self_attn.o_proj.weight": (cfg.hidden_size, cfg.num_heads * d),
            p + "post_attention_layernorm.weight": (cfg.hidden_size,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
            p + "mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size),
        }
    return shapes


_TO_GGUF = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
            "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf.startswith("layers."):
        _, i, rest = hf.split(".", 2)
        return f"blk.{i}.{_TO_GGUF[rest.removesuffix('.weight')]}.weight"
    return _TO_GGUF[hf.removesuffix(".weight")] + ".weight"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: within each head, the first and second
    halves are interleaved (row i of the first half goes to 2i, of the second to 2i + 1)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_hf_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in layer_names(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            std = 1.0 if name == "embed_tokens.weight" else 0.05
            out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return out


def raw_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of a K format (no quantiser in the gguf package), sane f16 scales."""
    values, nbytes = gguf.GGML_QUANT_SIZES[QType[kind]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // values, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[kind]:
        scale = rng.uniform(0.001, 0.01, size=blocks.shape[0]).astype("<f2")
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def encode_tensor(w: np.ndarray, kind: str, seed: int = 0) -> tuple[np.ndarray, QType]:
    """``w`` in ggml type ``kind``: quantised by gguf where it can, else random raw blocks of
    the right shape (the values then differ from ``w``; the tests compare against the file)."""
    qtype = QType[kind]
    if kind in _F16_FIELDS:
        raw = raw_blocks(kind, w.shape[0] if w.ndim == 2 else 1, w.shape[-1], seed)
        return (raw if w.ndim == 2 else raw.reshape(-1)), qtype
    return gguf.quants.quantize(w, qtype), qtype


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2 byte-level alphabet: printable bytes stand for themselves, the rest map to 256+.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    """264 tokens: 3 control tokens, the 256 byte-level symbols, 5 merged words."""
    byte_chars = _bytes_to_unicode()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [byte_chars[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in merges]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, merges


def write_llama_gguf(path: Path, weights: dict[str, np.ndarray], cfg: ModelConfig = TINY, *,
                     types: dict[str, str] | None = None, arch: str = "llama",
                     extra: dict | None = None) -> dict[str, tuple[np.ndarray, QType]]:
    """Write ``weights`` (HF names and layout) as a llama.cpp-style GGUF; ``types`` maps HF
    names to ggml types (default F32). Returns what was written per GGUF name (data, type)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_heads)
    w.add_vocab_size(cfg.vocab_size)
    tokens, token_types, merges = gpt2_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    written = {}
    for hf, data in weights.items():
        if hf.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, cfg.num_heads)
        elif hf.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, cfg.num_kv_heads)
        kind = (types or {}).get(hf, "F32")
        raw, qtype = encode_tensor(data, kind, seed=len(written))
        w.add_tensor(gguf_name(hf), raw, raw_dtype=qtype)
        written[gguf_name(hf)] = (raw, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
