"""Reading an HF ``config.json`` into a ModelConfig.

Accepts both spellings of RoPE settings: top-level ``rope_theta`` + ``rope_scaling`` (configs
written by transformers 4.x and Meta's releases) and the ``rope_parameters`` dict of
transformers 5.x. Only ``rope_type`` "default" and "llama3" are supported; others are refused
rather than silently ignored, since they would change every logit.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from tetris.config import ModelConfig, RopeScaling

__all__ = ["HFConfigError", "read_hf_config", "model_config_from_hf"]

_ARCHITECTURES = ("LlamaForCausalLM",)


class HFConfigError(ValueError):
    """The directory is not a supported HF Llama checkpoint."""


def read_hf_config(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_dir():
        raise HFConfigError(f"{p}: model directory does not exist")
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        raise HFConfigError(f"{p}: no config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{cfg_file}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise HFConfigError(f"{cfg_file}: expected a JSON object")
    return raw


def _rope(raw: dict, where: Path) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise HFConfigError(f"{where}: unsupported rope_type {rope_type!r} (default, llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise HFConfigError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def model_config_from_hf(path: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """The architecture of the HF directory ``path``, merged into ``base``.

    ``base`` keeps what the deployment decides (name, dtype, seed, path); architecture fields
    and token ids come from config.json. ``base.eos_token_ids``, when set, wins over the file.
    """
    p = Path(path)
    raw = read_hf_config(p)
    where = p / "config.json"
    archs = raw.get("architectures") or []
    if raw.get("model_type") != "llama" and not any(a in _ARCHITECTURES for a in archs):
        raise HFConfigError(
            f"{where}: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"only {', '.join(_ARCHITECTURES)} (model_type 'llama') is supported"
        )
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise HFConfigError(f"{where}: attention_bias / mlp_bias are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{where}: hidden_act {raw['hidden_act']!r} (only silu)")
    try:
        theta, scaling = _rope(raw, where)
        heads = int(raw["num_attention_heads"])
        base = base or ModelConfig(source="hf", path=str(p))
        merged = msgspec.structs.replace(
            base,
            source="hf",
            path=str(p),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=raw.get("head_dim"),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=base.eos_token_ids or _eos_ids(raw.get("eos_token_id")),
        )
        # replace() skips __post_init__; rebuilding runs ModelConfig's own checks.
        return ModelConfig(**msgspec.structs.asdict(merged))
    except KeyError as e:
        raise HFConfigError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise HFConfigError(f"{where}: {e}") from None
