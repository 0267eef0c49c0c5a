"""Reading a GGUF file's metadata: the model architecture as a ModelConfig.

A GGUF file (llama.cpp's format) holds key/value metadata and named tensors. The Llama keys
read here, all prefixed by the architecture name (``general.architecture``, which must be
``llama``):

    {arch}.block_count                          num_layers
    {arch}.embedding_length                     hidden_size
    {arch}.feed_forward_length                  intermediate_size
    {arch}.attention.head_count(_kv)            num_heads, num_kv_heads (kv defaults to heads)
    {arch}.attention.key_length                 head_dim (default hidden / heads)
    {arch}.rope.freq_base                       rope_theta (default 10000)
    {arch}.attention.layer_norm_rms_epsilon     rms_norm_eps (default 1e-5)
    {arch}.context_length                       max_position_embeddings
    {arch}.vocab_size                           vocab_size (default: the token list's length)
    tokenizer.ggml.bos/eos/eot/eom_token_id     bos_token_id, eos_token_ids

Tied embeddings are a file without ``output.weight``. What this model cannot run (mixtures of
experts, partial rotary, RoPE scaling, Llama-3.1 ``rope_freqs`` factors) is refused here,
since it would change every logit. Readers are cached per file (path, size, mtime): parsing
the metadata of a 49k-token vocabulary takes seconds, and the ingress, the config resolution
and the weights all ask for it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import msgspec

from tetris.config import ModelConfig
from tetris.model_files import resolve_model_file

__all__ = ["GGUFError", "GGUFFile", "open_gguf", "model_config_from_gguf"]


class GGUFError(ValueError):
    """The file is not a GGUF checkpoint of a supported Llama model."""


_MISSING = object()


class GGUFFile:
    """One GGUF file: typed metadata access and its tensors by name (memory-mapped)."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self._reader = GGUFReader(str(self.path), "r")
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.tensors = {t.name: t for t in self._reader.tensors}

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default=_MISSING):
        """The value of metadata ``key`` (scalars as Python values, arrays as lists)."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def array(self, key: str, default=_MISSING):
        """An array field as a numpy array (numbers) or a list of str (strings), without
        building one Python object per element for numbers."""
        import numpy as np
        from gguf import GGUFValueType

        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return np.empty(0)
        return np.concatenate([field.parts[i] for i in field.data])


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(spec: str | Path) -> GGUFFile:
    """The GGUF file ``spec`` names (a path or ``pkg:<distribution>/<file>``), cached."""
    path = resolve_model_file(str(spec)).resolve()
    st = path.stat()
    return _open_cached(str(path), st.st_size, st.st_mtime_ns)


def _eos_ids(gf: GGUFFile) -> tuple[int, ...]:
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = gf.get(f"tokenizer.ggml.{key}_token_id", None)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def _refuse_unsupported(gf: GGUFFile, arch: str) -> None:
    where = gf.path
    if int(gf.get(f"{arch}.expert_count", 0) or 0) > 0:
        raise GGUFError(f"{where}: a mixture-of-experts model ({arch}.expert_count > 0) is "
                        "not supported")
    scaling = gf.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise GGUFError(f"{where}: RoPE scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in gf.tensors:
        raise GGUFError(f"{where}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 "
                        "style scaling) are not supported for GGUF files yet; load the Hugging "
                        "Face directory instead")


def model_config_from_gguf(gf: GGUFFile, base: ModelConfig | None = None) -> ModelConfig:
    """The architecture of ``gf`` merged into ``base``, which keeps what the deployment decides
    (name, dtype, path); ``base.eos_token_ids``, when set, wins over the file's."""
    where = gf.path
    arch = gf.get("general.architecture", None)
    if arch != "llama":
        raise GGUFError(f"{where}: general.architecture is {arch!r}; only 'llama' is supported")
    _refuse_unsupported(gf, arch)
    try:
        heads = int(gf.get(f"{arch}.attention.head_count"))
        hidden = int(gf.get(f"{arch}.embedding_length"))
        head_dim = int(gf.get(f"{arch}.attention.key_length", hidden // heads))
        rotary = int(gf.get(f"{arch}.rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise GGUFError(f"{where}: partial rotary ({rotary} of {head_dim} dims) is not "
                            "supported")
        vocab = gf.get(f"{arch}.vocab_size", None)
        if vocab is None:
            vocab = len(gf.array("tokenizer.ggml.tokens"))
        base = base or ModelConfig(source="gguf", path=str(gf.path))
        merged = msgspec.structs.replace(
            base,
            source="gguf",
            path=base.path or str(gf.path),
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(gf.get(f"{arch}.feed_forward_length")),
            num_layers=int(gf.get(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(gf.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim if head_dim * heads != hidden else None,
            max_position_embeddings=int(gf.get(f"{arch}.context_length")),
            rope_theta=float(gf.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=None,
            rms_norm_eps=float(gf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in gf.tensors,
            bos_token_id=_optional_int(gf.get("tokenizer.ggml.bos_token_id", None)),
            eos_token_ids=base.eos_token_ids or _eos_ids(gf),
        )
        # replace() skips __post_init__; rebuilding runs ModelConfig's own checks.
        return ModelConfig(**msgspec.structs.asdict(merged))
    except (TypeError, ValueError) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{where}: {e}") from None


def _optional_int(value) -> int | None:
    return None if value is None else int(value)
