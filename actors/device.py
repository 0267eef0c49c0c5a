"""An actor's device and KV block count, from its config and what it was given (docs/gpu.md).

The rules are pure functions in ``tetris.device``; this module asks the process what they need:
whether CUDA is available, which GPUs Ray assigned to the actor, the GPU's total memory and
the loaded weights' bytes. Prefill workers and decode ranks call ``actor_device`` before they
load the model and ``kv_blocks_on_device`` before they allocate their KV cache.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from tetris.config import DecodeConfig, ModelConfig, PrefillConfig
from tetris.device import (
    GIB,
    check_kv_blocks,
    dtype_for_device,
    kv_blocks_that_fit,
    resolve_device,
)
from tetris.errors import ConfigError

__all__ = [
    "actor_device",
    "decode_kv_blocks",
    "kv_blocks_on_device",
    "least_over_group",
    "load_model_on_device",
    "prefill_kv_blocks",
    "ray_gpu_ids",
    "weight_bytes",
]

log = logging.getLogger(__name__)


def ray_gpu_ids() -> list | None:
    """The GPU ids Ray assigned to this process; None outside a Ray worker."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return list(ray.get_gpu_ids())
    except ImportError:    # no Ray here (the GPU checks run the engine and pools without it)
        return None
    except RuntimeError:   # not a Ray worker (a driver without a connection)
        return None


def actor_device(model_cfg: ModelConfig) -> tuple[str, ModelConfig]:
    """("cuda" or "cpu", the model config with its dtype made concrete for that device);
    ``model.device = "cuda"`` without CUDA raises a ``ConfigError`` naming CUDA."""
    device = resolve_device(model_cfg.device, torch.cuda.is_available(), ray_gpu_ids())
    dtype = dtype_for_device(model_cfg.dtype, device)
    log.info("model %s on %s in %s", model_cfg.name, device, dtype)
    return device, msgspec.structs.replace(model_cfg, dtype=dtype)


def load_model_on_device(model_cfg: ModelConfig, *, tp_group=None):
    """(model, tokenizer, device): ``load_model`` on the device ``actor_device`` resolves."""
    from tetris.model.loader import load_model

    device, resolved = actor_device(model_cfg)
    model, tokenizer = load_model(resolved, tp_group=tp_group, device=device)
    return model, tokenizer, device


def decode_kv_blocks(dc: DecodeConfig, model, device: str) -> int:
    """A decode rank's KV blocks: ``decode.kv_blocks``, checked against its GPU on CUDA; with
    0 (CUDA only) every block that fits, agreed as the least over the model's TP group, since
    the ranks' engines must admit and preempt alike (their block managers run in lockstep)."""
    blocks = kv_blocks_on_device(dc.kv_blocks, device=device, model=model,
                                 block_size=dc.block_size, utilization=dc.gpu_memory_utilization,
                                 reserve_gib=dc.activation_reserve_gib, gpus=dc.gpus_per_rank,
                                 what="decode.kv_blocks")
    if dc.kv_blocks == 0 and getattr(model, "tp_group", None) is not None:
        blocks = least_over_group(blocks, model.tp_group, device)
    return blocks


def least_over_group(value: int, group, device: str) -> int:
    """The least ``value`` over every rank of ``group`` (an all-reduce; on NCCL a CUDA tensor)."""
    import torch.distributed as dist

    on = device if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def prefill_kv_blocks(pc: PrefillConfig, model, device: str) -> int:
    """A prefill worker's KV store blocks (``prefill.kv_blocks_per_instance``; on CUDA 0 takes
    every block that fits). Each of an instance's TP ranks holds 1/tp of its GPUs
    (``actors/prefill/tp.py`` rank_options)."""
    return kv_blocks_on_device(pc.kv_blocks_per_instance, device=device, model=model,
                               block_size=pc.block_size, utilization=pc.gpu_memory_utilization,
                               reserve_gib=pc.activation_reserve_gib,
                               gpus=pc.gpus_per_instance / pc.tp_size,
                               what="prefill.kv_blocks_per_instance")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's (local) parameters and buffers."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_blocks_on_device(configured: int, *, device: str, model, block_size: int,
                        utilization: float, reserve_gib: float, gpus: float,
                        what: str) -> int:
    """The KV block count to allocate: ``configured`` on the CPU; on CUDA, checked against (or,
    for 0, taken from) the memory left after the weights (``tetris.device`` rule 4)."""
    if device != "cuda":
        if configured <= 0:
            raise ConfigError(f"{what} = {configured}: sizing the KV cache from memory needs "
                              "CUDA; on the CPU set a positive block count")
        return configured
    from tetris.engine.kv_cache import kv_bytes_per_block

    _free, total = torch.cuda.mem_get_info(torch.cuda.current_device())
    block = kv_bytes_per_block(model.num_layers, block_size, model.local_num_kv_heads,
                               model.head_dim, model.dtype)
    share = min(1.0, gpus) if gpus > 0 else 1.0
    args = {"total_bytes": float(total), "utilization": utilization,
            "weight_bytes": float(weight_bytes(model)), "reserve_bytes": reserve_gib * GIB,
            "block_bytes": float(block), "share": share}
    blocks = check_kv_blocks(configured, what=what, **args)
    log.info("%s: %d KV blocks on CUDA (%.2f GiB; %d would fit at utilization %g)", what,
             blocks, blocks * block / GIB, kv_blocks_that_fit(**args), utilization)
    return blocks
