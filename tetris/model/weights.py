"""Filling a LlamaModel: HF safetensors checkpoints (single file or sharded index) or
deterministic dummy weights from a seed.

Both paths produce *full* tensors under HF names and hand them to ``load_tensor``, which keeps
this rank's shard: every TP rank therefore ends with slices of the same full model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tetris.model.llama import LlamaModel
from tetris.model.parallel import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "WeightsError",
    "load_tensor",
    "load_hf_weights",
    "init_dummy_weights",
    "iter_safetensors",
    "safetensors_files",
]

# Dummy init: small normal projections keep the residual stream and the logits in a sane range;
# the embedding is larger so that different tokens give clearly different hidden states
# (with 0.02 a tiny random model mostly repeats itself).
_DUMMY_STD = 0.02
_DUMMY_EMBED_STD = 1.0


class WeightsError(ValueError):
    """A checkpoint is missing, incomplete, or does not fit the model."""


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def load_tensor(model: LlamaModel, name: str, full: torch.Tensor) -> None:
    """Copy one full HF tensor (``model.`` prefix optional) into ``model``, keeping this rank's
    shard. Raises WeightsError for unknown names and shape mismatches."""
    local = _strip(name)
    if local == "lm_head.weight" and model.lm_head is None:
        return  # tied checkpoints sometimes store the shared matrix twice
    module_path, _, param = local.rpartition(".")
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        raise WeightsError(f"checkpoint tensor {name!r} has no place in the model") from None
    if param != "weight":
        raise WeightsError(f"checkpoint tensor {name!r}: only bias-free Llama weights are supported")
    try:
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.load_full(full.to(module.weight.dtype))
            return
        target = module.weight
        if target.shape != full.shape:
            raise ValueError(f"shape {tuple(full.shape)} != expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(full)
    except ValueError as e:
        raise WeightsError(f"checkpoint tensor {name!r}: {e}") from None


def expected_names(model: LlamaModel) -> list[str]:
    """HF names (without ``model.``) a complete checkpoint must provide, in model order."""
    return [n for n, _ in model.named_parameters()]


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of an HF directory: the sharded index's files, or model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index}: not a valid safetensors index ({e})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise WeightsError(f"{index} lists missing shard files: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise WeightsError(
        f"{path}: no safetensors weights (expected model.safetensors or "
        "model.safetensors.index.json)"
    )


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of ``files``, in file then sorted-name order."""
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            for name in sorted(reader.keys()):
                yield name, reader.get_tensor(name)


def load_hf_weights(model: LlamaModel, path: str | Path) -> None:
    """Load every tensor of an HF Llama directory into ``model``; all parameters must be set."""
    path = Path(path)
    loaded: set[str] = set()
    for name, tensor in iter_safetensors(safetensors_files(path)):
        if "rotary_emb" in name:
            continue  # old checkpoints store inv_freq; it is recomputed from the config
        load_tensor(model, name, tensor)
        loaded.add(_strip(name))
    missing = [n for n in expected_names(model) if n not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise WeightsError(f"{path}: checkpoint lacks {len(missing)} tensors: {shown}")


def _dummy_full_shape(model: LlamaModel, name: str) -> tuple[int, ...]:
    module = model.get_submodule(name.rpartition(".")[0])
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return (module.out_features, module.in_features)
    return tuple(module.weight.shape)


@torch.no_grad()
def init_dummy_weights(model: LlamaModel, seed: int) -> None:
    """Deterministic weights from ``seed``: the same full tensors on every TP rank.

    Norm weights are 1; matrices are normal with small std, drawn on CPU in fp32 in model
    parameter order, so the values do not depend on device, dtype or TP size.
    """
    gen = torch.Generator().manual_seed(seed)
    for name in expected_names(model):
        shape = _dummy_full_shape(model, name)
        if name.endswith("norm.weight"):
            full = torch.ones(shape)
        else:
            std = _DUMMY_EMBED_STD if name == "embed_tokens.weight" else _DUMMY_STD
            full = torch.randn(shape, generator=gen) * std
        load_tensor(model, name, full)
