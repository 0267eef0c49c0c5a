"""The prefill worker: one Ray actor per prefill instance of the SP pool.

The pool's workers form one torch.distributed world, made once (``init_world``); a chunk's
ring and its cache balancing use point-to-point operations on that world between the chunk's
members only. A worker runs one chunk at a time (Ray's default actor concurrency of one); the
scheduler keeps the groups of concurrently running chunks disjoint, and every chunk's messages
carry their own tags, so rings of different requests never mix.
"""

from __future__ import annotations

import os
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from tetris.actors.executor import EmulatedExecutor, ModelExecutor
from tetris.actors.kv_store import PagedKVStore
from tetris.actors.prefill_messages import ChunkResult, ChunkTask
from tetris.config import ModelConfig, PrefillConfig

__all__ = ["PrefillWorker"]


class PrefillWorker:
    """Wraps an executor (real model or emulated) and the instance's KV store."""

    def __init__(self, instance: int, node: int, model_cfg: ModelConfig,
                 prefill_cfg: PrefillConfig, *, profile: str | None = None,
                 threads: int = 1) -> None:
        # Several workers share few cores: one intra-op thread each avoids oversubscription.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        self.instance = instance
        self.node = node
        self.store: PagedKVStore | None = None
        if prefill_cfg.executor == "emulated":
            from tetris.scheduler.latency import load_profile

            if profile is None:
                raise ValueError("the emulated executor needs a latency profile")
            self.executor = EmulatedExecutor(load_profile(profile))
        else:
            from tetris.model.loader import load_model

            model, _tok = load_model(model_cfg)
            self.store = PagedKVStore(
                model.num_layers, prefill_cfg.kv_blocks_per_instance, prefill_cfg.block_size,
                model.local_num_kv_heads, model.head_dim, dtype=model.dtype,
            )
            self.executor = ModelExecutor(model, self.store)

    def init_world(self, host: str, port: int, world_size: int, timeout_s: float) -> int:
        """Join the pool's world (gloo); every worker must call this at the same time.

        Called again after a failed ring: the old world (whose timed-out connections gloo
        closed) is dropped first. KV stores are untouched.
        """
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(
            "gloo", init_method=f"tcp://{host}:{port}", rank=self.instance,
            world_size=world_size, timeout=timedelta(seconds=timeout_s),
        )
        dist.barrier()
        return dist.get_rank()

    def prepare(self, task: ChunkTask) -> None:
        self._check(task)
        self.executor.prepare(task)

    def execute(self, task: ChunkTask) -> ChunkResult:
        self._check(task)
        return self.executor.execute(task)

    def _check(self, task: ChunkTask) -> None:
        if task.instance != self.instance:
            raise ValueError(f"task for instance {task.instance} sent to {self.instance}")

    def abort(self, request_id: str) -> None:
        self.executor.abort(request_id)

    def release(self, request_id: str) -> None:
        """The request's KV was handed off (or is no longer needed): free it."""
        self.executor.abort(request_id)

    def export_kv(self, request_id: str):
        """(positions [n], k [L, n, Hkv, D], v [L, n, Hkv, D]) held here, for hand-off or tests."""
        if self.store is None:
            raise RuntimeError("an emulated worker holds no KV")
        return self.store.export(request_id)

    def held_requests(self) -> list[str]:
        return self.store.requests() if self.store is not None else []

    def free_blocks(self) -> int:
        return self.store.free_blocks if self.store is not None else 0

    def set_fault(self, request_id: str, chunk_index: int, layer: int) -> None:
        """Test hook: fail once when ``request_id``'s chunk reaches ``layer``."""
        self.executor.fault = (request_id, chunk_index, layer)

    def node_index(self) -> int:
        return self.node

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


PrefillWorkerActor = ray.remote(PrefillWorker)
