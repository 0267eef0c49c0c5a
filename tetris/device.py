"""Where a served model runs, and how much KV cache its device holds (pure: no torch, no ray).

Rules (docs/gpu.md):

1. ``model.device``: "cpu" runs on the CPU; "cuda" needs CUDA in the actor's process; "auto"
   (the default) is CUDA when Ray gave the actor a GPU (its GPU ids) and CUDA is available, and
   the CPU otherwise, outside Ray too: a worker or rank built in-process (tests) stays on the
   CPU even on a GPU machine (``resolve_device``). "cuda" without CUDA is a ``ConfigError`` at
   start naming CUDA, not a failure on the first request.
2. ``model.dtype = "auto"`` (the default) is bfloat16 on CUDA and float32 on the CPU, today's
   CPU default (``dtype_for_device``).
3. GPUs asked of Ray per placement bundle (``bundle_gpus``): the configured
   ``prefill.gpus_per_instance`` / ``decode.gpus_per_rank`` when positive (a fraction puts
   several actors on one GPU); with ``device = "cuda"`` and none configured, one GPU per TP
   rank; 0 otherwise, so the CPU deployments reserve no GPU. ``device = "cpu"`` with GPUs
   configured is a contradiction and an error.
4. KV blocks on CUDA (``kv_blocks_that_fit``), as vLLM's ``gpu_memory_utilization``::

       blocks = floor((utilization * share * total - weights - activation reserve) / block bytes)

   ``share`` is the actor's part of its GPU (its fractional ``num_gpus``, at most 1). A model
   whose weights and reserve leave no block fails at start with the numbers
   (``KVMemoryError``); so does a configured block count above what fits. On the CPU the
   configured count is used as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tetris.errors import ConfigError

if TYPE_CHECKING:
    from tetris.config import DeploymentConfig

__all__ = [
    "GIB",
    "KVMemoryError",
    "bundle_gpus",
    "check_cluster_gpus",
    "check_device_bundles",
    "check_kv_blocks",
    "deployment_gpus",
    "dtype_for_device",
    "kv_blocks_that_fit",
    "resolve_device",
    "with_device_defaults",
]

GIB = float(1 << 30)


class KVMemoryError(ConfigError):
    """The model, or the configured KV cache, does not fit the device's memory."""


def resolve_device(requested: str, cuda_available: bool,
                   ray_gpu_ids: Sequence[object] | None) -> str:
    """"cuda" or "cpu" for an actor (rule 1). ``ray_gpu_ids``: the GPUs Ray assigned to the
    actor, None when not running under Ray."""
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        if not cuda_available:
            raise ConfigError("model.device = 'cuda' but CUDA is not available in this process "
                              f"(torch.cuda.is_available() is False; GPUs Ray assigned: "
                              f"{list(ray_gpu_ids or [])}): install the gpu extra on a machine "
                              "with an NVIDIA GPU, or set model.device = 'cpu' or 'auto'")
        return "cuda"
    if requested != "auto":
        raise ConfigError(f"model.device must be auto, cuda or cpu, got {requested!r}")
    return "cuda" if cuda_available and ray_gpu_ids else "cpu"


def dtype_for_device(dtype: str, device: str) -> str:
    """The concrete dtype name: "auto" is bfloat16 on CUDA, float32 on the CPU (rule 2)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"


def bundle_gpus(device: str, configured: float, tp_ranks: int, table: str, key: str) -> float:
    """GPUs one placement bundle asks for (rule 3); ``tp_ranks``: TP ranks the bundle holds."""
    if configured > 0:
        if device == "cpu":
            raise ConfigError(f"model.device = 'cpu' but {table}.{key} = {configured:g} GPUs: "
                              f"drop {table}.{key} or set model.device = 'cuda' or 'auto'")
        return float(configured)
    return float(tp_ranks) if device == "cuda" else 0.0


def with_device_defaults(cfg: DeploymentConfig) -> DeploymentConfig:
    """``cfg`` with the GPUs per prefill and decode bundle filled in from the device (rule 3)."""
    import msgspec

    device, pc, dc = cfg.model.device, cfg.prefill, cfg.decode
    pg = bundle_gpus(device, pc.gpus_per_instance, pc.tp_size, "prefill", "gpus_per_instance")
    dg = bundle_gpus(device, dc.gpus_per_rank, 1, "decode", "gpus_per_rank")
    if (pg, dg) == (pc.gpus_per_instance, dc.gpus_per_rank):
        return cfg
    return msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(pc, gpus_per_instance=pg),
        decode=msgspec.structs.replace(dc, gpus_per_rank=dg))


def check_device_bundles(bundles: Sequence[dict[str, float]], cluster_gpus: float,
                         what: str) -> None:
    """Fail at start, naming CUDA, when bundles ask for GPUs the Ray cluster does not have at
    all (an actor that asks for a GPU no node has would wait forever, not fail)."""
    need = sum(b.get("GPU", 0.0) for b in bundles)
    if need > 0 and cluster_gpus + 1e-9 < need:
        raise ConfigError(f"{what} asks for {need:g} GPUs (CUDA) but the Ray cluster has "
                          f"{cluster_gpus:g}: run on nodes with CUDA GPUs, or set "
                          "model.device = 'cpu' (or 'auto' with no GPUs per bundle)")


def deployment_gpus(cfg: DeploymentConfig) -> float:
    """GPUs the whole deployment asks of Ray: every prefill bundle and every decode rank."""
    pc, dc = cfg.prefill, cfg.decode
    return pc.num_instances * pc.gpus_per_instance + dc.num_instances * dc.tp_size * dc.gpus_per_rank


def check_cluster_gpus(cfg: DeploymentConfig, cluster_gpus: float) -> None:
    """At start (``tetris serve``, once Ray is up): the deployment's GPUs must exist."""
    need = deployment_gpus(cfg)
    if need > 0 and cluster_gpus + 1e-9 < need:
        raise ConfigError(f"model.device = {cfg.model.device!r}: the deployment asks for "
                          f"{need:g} GPUs (CUDA) but the Ray cluster has {cluster_gpus:g}: run "
                          "it on nodes with CUDA GPUs, or set model.device = 'cpu'")


def kv_blocks_that_fit(*, total_bytes: float, utilization: float, weight_bytes: float,
                       reserve_bytes: float, block_bytes: float, share: float = 1.0) -> int:
    """KV blocks one actor's device memory holds after its weights (rule 4; may be <= 0)."""
    if not 0 < utilization <= 1 or not 0 < share <= 1 or block_bytes <= 0:
        raise ValueError(f"need 0 < utilization <= 1, 0 < share <= 1 and block_bytes > 0, got "
                         f"{utilization}, {share}, {block_bytes}")
    left = utilization * share * total_bytes - weight_bytes - reserve_bytes
    return int(left // block_bytes)


def check_kv_blocks(configured: int, *, total_bytes: float, utilization: float,
                    weight_bytes: float, reserve_bytes: float, block_bytes: float,
                    share: float = 1.0, what: str = "decode.kv_blocks") -> int:
    """The configured block count when it fits the device (rule 4), else a ``KVMemoryError``
    with the numbers; ``configured`` 0 takes every block that fits."""
    fit = kv_blocks_that_fit(total_bytes=total_bytes, utilization=utilization,
                             weight_bytes=weight_bytes, reserve_bytes=reserve_bytes,
                             block_bytes=block_bytes, share=share)
    budget = (f"{utilization:g} x {share * total_bytes / GIB:.2f} GiB GPU memory "
              f"(utilization x total) - {weight_bytes / GIB:.2f} GiB weights - "
              f"{reserve_bytes / GIB:.2f} GiB activation reserve")
    if fit < 1:
        raise KVMemoryError(f"the model does not fit: {budget} leaves no KV block of "
                            f"{block_bytes / (1 << 20):.2f} MiB; use more GPUs (TP) or raise "
                            "gpu_memory_utilization")
    if configured > fit:
        raise KVMemoryError(f"{what} = {configured} blocks of {block_bytes / (1 << 20):.2f} MiB "
                            f"({configured * block_bytes / GIB:.2f} GiB) do not fit: {budget} "
                            f"holds {fit}; lower {what} or raise gpu_memory_utilization")
    return configured or fit
