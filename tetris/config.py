"""Deployment configuration: TOML files decoded into frozen msgspec Structs.

A deployment file has these tables, each optional except ``[model]``::

    [model]        what to serve: a seeded tiny Llama, a local Hugging Face directory, or a
                   GGUF file (a path, or ``pkg:<distribution>/<file>`` in an installed package)
    [prefill]      the sequence-parallel pool: instance count, TP size, instances per node
    [decode]       decode instances: count, TP size, batch and KV capacity
    [scheduler]    CDSP policy, SP candidates, latency profile, improvement rate
    [transfer]     KV streaming: backend, receive buffers, piece sizes, timeouts
                   (its struct lives in tetris/transfer_config.py, re-exported here)
    [emulation]    EMULATION only: the time scale of emulated decode steps
    [prefix_cache], [sp_layout], [csa], [kunserve]
                   the features of the other systems, off by default (their structs live in
                   tetris/feature_config.py, re-exported here)

Unknown keys and wrong types are rejected with a ``ConfigError`` that names the file, the key
and what was expected. Configs are passed down explicitly; there is no global config.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec

from tetris.errors import ConfigError
from tetris.feature_config import CsaConfig, KunServeConfig, PrefixCacheConfig, SpLayoutConfig
from tetris.model_files import PACKAGE_PREFIX, resolve_model_file
from tetris.transfer_config import TransferConfig

__all__ = [
    "ConfigError",
    "ModelConfig",
    "RopeScaling",
    "PrefillConfig",
    "DecodeConfig",
    "SchedulerConfig",
    "TransferConfig",
    "DeploymentConfig",
    "EmulationConfig",
    "PrefixCacheConfig",
    "SpLayoutConfig",
    "CsaConfig",
    "KunServeConfig",
    "load_deployment",
    "default_deployment_path",
    "DEFAULT_DEPLOYMENT",
]

DEFAULT_DEPLOYMENT = "tiny-cpu.toml"


class RopeScaling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Llama-3 style RoPE frequency scaling (``rope_type = "llama3"`` in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: Literal["llama3"] = "llama3"


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Architecture of a Llama-family model.

    ``source = "dummy"`` builds deterministic weights from ``seed`` (the tiny default model);
    ``source = "hf"`` loads config, weights and tokenizer from the local directory ``path``
    (the architecture fields are then read from its ``config.json``);
    ``source = "gguf"`` loads them from the GGUF file ``path``, a file path or
    ``pkg:<distribution>/<file>`` (``resolve_model_file``; docs/models.md).
    """

    name: str = "tetris-tiny-llama"
    source: Literal["dummy", "hf", "gguf"] = "dummy"
    path: str | None = None
    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # "auto": bfloat16 on CUDA, float32 on the CPU (tetris/device.py, docs/gpu.md)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # "auto": CUDA when Ray gave the actor a GPU (prefill.gpus_per_instance,
    # decode.gpus_per_rank), else the CPU; "cuda" without CUDA fails at start
    device: Literal["auto", "cuda", "cpu"] = "auto"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.source in ("hf", "gguf") and not self.path:
            raise ValueError(f"model.path is required when model.source = '{self.source}'")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "max_position_embeddings"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_heads ({self.num_heads}) unless model.head_dim is set"
            )

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


class PrefillConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The prefill pool: ``num_instances`` instances of ``tp_size`` devices, ``node_size`` per node."""

    num_instances: int = 4
    tp_size: int = 1
    node_size: int = 2
    executor: Literal["model", "emulated"] = "model"
    # EMULATION only: a measurement table (CSV of the profile's format, a path or a file in
    # configs/profiles/) whose times the emulated workers wait instead of the profile's
    # prediction, while the dispatcher still plans on the profile (tetris.scheduler.execution,
    # docs/emulation.md): the live control plane then meets plans that miss, as on hardware.
    emulated_measurements: str | None = None
    block_size: int = 16
    kv_blocks_per_instance: int = 4096
    # Ray placement (actors/placement.py): "auto" places with a placement group ("pack") on a
    # multi-node cluster and not at all ("none") on one node, where the workers share the node
    # anyway and a 2-core box must still run the tiny deployment. One bundle per instance.
    placement: Literal["auto", "pack", "spread", "none"] = "auto"
    cpus_per_instance: float = 1.0
    gpus_per_instance: float = 0.0   # model.device = "cuda" and 0: tp_size (tetris/device.py)
    # On CUDA the instance's KV store must fit this share of its GPU after the weights and the
    # activation reserve (tetris/device.py); kv_blocks_per_instance = 0 takes all that fits.
    gpu_memory_utilization: float = 0.9
    activation_reserve_gib: float = 4.0

    def __post_init__(self) -> None:
        if self.num_instances <= 0 or self.tp_size <= 0 or self.node_size <= 0:
            raise ValueError("prefill.num_instances, tp_size and node_size must be positive")
        _check_bundle("prefill", self.cpus_per_instance, self.gpus_per_instance)
        _check_memory("prefill", self.gpu_memory_utilization, self.activation_reserve_gib)
        if self.kv_blocks_per_instance < 0:
            raise ValueError("prefill.kv_blocks_per_instance must be >= 0 (0: all that fits "
                             f"on CUDA), got {self.kv_blocks_per_instance}")
        if self.emulated_measurements is not None and self.executor != "emulated":
            raise ValueError("prefill.emulated_measurements needs prefill.executor = "
                             f"'emulated' (a real model takes its own time), got {self.executor!r}")
        if self.num_instances % self.node_size:
            raise ValueError(
                f"prefill.num_instances ({self.num_instances}) must be a multiple of "
                f"prefill.node_size ({self.node_size})"
            )


class DecodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode instances, each a tensor-parallel group of ``tp_size`` workers."""

    num_instances: int = 1
    tp_size: int = 2
    max_batch_size: int = 32
    block_size: int = 16
    kv_blocks: int = 8192   # 0: every block that fits the rank's GPU (CUDA only)
    executor: Literal["model", "emulated"] = "model"
    # One placement group per instance, one bundle per TP rank, STRICT_PACK (a TP group never
    # spans nodes); "auto" = "pack" on a multi-node cluster, "none" on one node.
    placement: Literal["auto", "pack", "none"] = "auto"
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0   # model.device = "cuda" and 0: 1 (tetris/device.py)
    # On CUDA kv_blocks must fit this share of the rank's GPU after the weights and the
    # activation reserve, or the rank fails at start with the numbers (tetris/device.py).
    gpu_memory_utilization: float = 0.9
    activation_reserve_gib: float = 2.0
    # Elastic decode (issue #25): a request whose KV fits no single instance but the free
    # room of several is placed over a decode group (tetris/serve/elastic_dispatch.py)
    elastic: bool = False

    def __post_init__(self) -> None:
        if min(self.num_instances, self.tp_size, self.max_batch_size, self.block_size) <= 0:
            raise ValueError("decode.* sizes must be positive")
        # kv_blocks = 0 is sized by each rank from its GPU's memory; the instance reports the
        # count to the dispatcher (docs/gpu.md). An emulated engine has no GPU to size from.
        if self.kv_blocks < 0 or (self.kv_blocks == 0 and self.executor == "emulated"):
            raise ValueError(f"decode.kv_blocks must be positive, or 0 (every block that fits, "
                             f"CUDA only) with executor 'model'; got {self.kv_blocks}")
        _check_bundle("decode", self.cpus_per_rank, self.gpus_per_rank)
        _check_memory("decode", self.gpu_memory_utilization, self.activation_reserve_gib)


def _check_bundle(table: str, cpus: float, gpus: float) -> None:
    # Ray rejects a placement-group bundle with no resources at all.
    if cpus < 0 or gpus < 0 or cpus + gpus <= 0:
        raise ValueError(f"{table}: CPUs and GPUs per bundle must be >= 0 and not both 0, "
                         f"got {cpus} CPUs and {gpus} GPUs")


def _check_memory(table: str, utilization: float, reserve_gib: float) -> None:
    if not 0 < utilization <= 1 or reserve_gib < 0:
        raise ValueError(f"{table}.gpu_memory_utilization must be in (0, 1] and "
                         f"{table}.activation_reserve_gib >= 0, got {utilization} and {reserve_gib}")


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill planning: the policy, its SP candidates and latency profile, and θ."""

    policy: str = "tetris"
    sp_candidates: tuple[int, ...] = ()
    profile: str | None = None
    improvement_rate: float = 0.3
    rate_table: str | None = None
    rate_window_s: float = 60.0
    rate_update_interval_s: float = 30.0
    # A window holding fewer arrivals stretches back to the Nth latest one (RateMonitor
    # min_arrivals): at low rates (70B) a 60 s window is too few arrivals to pick θ from.
    # The simulator's experiments use 100 (tetris/sim/experiments.py).
    rate_min_arrivals: int = 100
    min_chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if self.rate_min_arrivals < 0:
            raise ValueError(f"scheduler.rate_min_arrivals must be >= 0, got {self.rate_min_arrivals}")
        if not 0.0 <= self.improvement_rate < 1.0:
            raise ValueError(
                f"scheduler.improvement_rate must be in [0, 1), got {self.improvement_rate}"
            )
        for s in self.sp_candidates:
            if s <= 0 or s & (s - 1):
                raise ValueError(f"scheduler.sp_candidates must be powers of two, got {s}")


class EmulationConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """EMULATION (``executor = "emulated"``): emulated decode steps take ``time_scale`` × the
    decode latency model's time (``tetris bench fidelity --time-scale`` also scales the prefill
    profile and the emulated link; docs/emulation.md)."""

    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"emulation.time_scale must be positive, got {self.time_scale}")


class DeploymentConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelConfig
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    transfer: TransferConfig = TransferConfig()
    emulation: EmulationConfig = EmulationConfig()
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    sp_layout: SpLayoutConfig = SpLayoutConfig()
    csa: CsaConfig = CsaConfig()
    kunserve: KunServeConfig = KunServeConfig()
    source_path: str | None = None


def default_deployment_path() -> Path:
    """Path of the embedded default deployment (tiny seeded Llama on CPU)."""
    return Path(str(resources.files("tetris.configs").joinpath(DEFAULT_DEPLOYMENT)))


def _resolve(path: str | Path | None) -> Path:
    if path is None:
        return default_deployment_path()
    p = Path(path)
    if p.exists():
        return p
    embedded = Path(str(resources.files("tetris.configs").joinpath(str(path))))
    if embedded.exists():
        return embedded
    raise ConfigError(f"{path}: no such deployment file (nor an embedded config of that name)")


def load_deployment(path: str | Path | None = None) -> DeploymentConfig:
    """Load a deployment TOML; ``None`` loads the embedded default.

    Relative ``model.path`` values resolve against the config file's folder; a GGUF file that
    is not there is an error now, not when the first worker loads it.
    """
    p = _resolve(path)
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    try:
        cfg = msgspec.convert(raw, DeploymentConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{p}: {_explain(e)}") from None
    model = cfg.model
    if (model.path is not None and not model.path.startswith(PACKAGE_PREFIX)
            and not Path(model.path).is_absolute()):
        model = msgspec.structs.replace(model, path=str((p.parent / model.path).resolve()))
    if model.source == "gguf":
        try:
            resolve_model_file(model.path)
        except ConfigError as e:
            raise ConfigError(f"{p}: model.path: {e}") from None
    from tetris.device import with_device_defaults

    try:   # GPUs per bundle from model.device (tetris/device.py rule 3)
        cfg = with_device_defaults(cfg)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    return msgspec.structs.replace(cfg, model=model, source_path=str(p))


def _explain(err: msgspec.ValidationError) -> str:
    # msgspec says e.g. "Expected `int`, got `str` - at `$.prefill.num_instances`" or
    # "Object contains unknown field `foo` - at `$.model`"; turn the JSON path into a TOML key.
    msg = str(err)
    text, sep, where = msg.rpartition(" - at `")
    if not sep:
        return msg
    key = where.rstrip("`").removeprefix("$").lstrip(".")
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        full = f"{key}.{field}" if key else field
        return f"unknown key `{full}`"
    return f"key `{key or '<root>'}`: {text}"
