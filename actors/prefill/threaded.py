"""The prefill pool's chunks in one process: each instance a thread, one gloo world among them.

``PrefillPool`` runs every instance in its own Ray actor; ``ThreadedPool`` runs the same
``ModelExecutor`` bodies on threads of one process, sharing one model. The chunk tasks, the
layouts, the ring, cache balancing and the result are those of the pool (``chunks.chunk_task``,
``layout.plan_layout``, ``chunks.prefill_result``): only the transport of the phases differs.
It exists for the machines Ray is not on (the GPU checks: ring steps on CUDA tensors, the
links staged through host memory by ``actors/collectives.py``) and for quick exactness checks.

No scheduling, healing or streaming: one request at a time, and a failed chunk fails the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from tetris.actors.collectives import rank_device
from tetris.actors.prefill.chunks import RunOptions, chunk_task, prefill_result
from tetris.actors.prefill.executor import ModelExecutor
from tetris.actors.prefill.kv_store import PagedKVStore
from tetris.actors.prefill.layout import plan_layout
from tetris.actors.prefill.messages import BalanceMode, ChunkResult, PrefillError, PrefillResult
from tetris.actors.prefill.world import World, free_port
from tetris.config import CsaConfig
from tetris.plan import PrefillPlan
from tetris.sampling_params import SamplingParams
from tetris.token_ids import compact_tokens

__all__ = ["ThreadedPool"]


class ThreadedPool:
    """``num_instances`` prefill instances of ``model`` (on the model's device) in this process."""

    def __init__(self, model, num_instances: int, *, num_blocks: int, block_size: int,
                 timeout_s: float = 60.0, node_of: Sequence[int] = ()) -> None:
        if num_instances < 1:
            raise ValueError("a pool needs at least one instance")
        self.model = model
        self.size = num_instances
        self.timeout_s = timeout_s
        self.node_of = tuple(node_of)   # instances' nodes, if any: SP-TP goes hierarchical
        device = str(model.device)
        self.stores = [PagedKVStore(model.num_layers, num_blocks, block_size,
                                    model.local_num_kv_heads, model.head_dim,
                                    dtype=model.dtype, device=device)
                       for _ in range(num_instances)]
        self.executors = [ModelExecutor(model, s) for s in self.stores]
        # Every rank on one device: the seam picks gloo (NCCL refuses two ranks on one GPU) and
        # stages CUDA tensors through host memory.
        self.links = self._form_world(rank_device(device))
        self.backend = self.links[0].backend
        self._seq = 0

    def _form_world(self, me) -> list[World]:
        port, worlds, errors = free_port(), [None] * self.size, []

        def join(rank: int) -> None:
            try:
                worlds[rank] = World(0, "127.0.0.1", port, rank, self.size, self.timeout_s,
                                     device=me)
            except Exception as e:  # noqa: BLE001 - raised below, with the rank
                errors.append((rank, e))

        _all(join, range(self.size), self.timeout_s)
        if errors:
            raise PrefillError(f"the local world did not form: rank {errors[0][0]}: "
                               f"{errors[0][1]}")
        return worlds

    def run(self, plan: PrefillPlan, token_ids: Sequence[int], *,
            sampling: SamplingParams | None = None, return_logits: bool = False,
            balance: BalanceMode = "overlap", kv_ranges: tuple = (),
            csa: CsaConfig | None = None) -> PrefillResult:
        """Prefill ``token_ids`` by ``plan``; returns the first token (and logits if asked).
        The request's KV stays in the members' stores until ``release``. ``csa`` enabled:
        LOSSY sparse attention in ring chunks (csa_ring.py)."""
        plan.validate(self.size)
        ids = compact_tokens(token_ids)
        if len(ids) != plan.prompt_tokens:
            raise ValueError(f"plan {plan.request_id} is for {plan.prompt_tokens} tokens, "
                             f"the prompt has {len(ids)}")
        opts = RunOptions(balance, sampling, return_logits, (), None, None,
                          kv_ranges=tuple(kv_ranges), csa=csa)   # streamed by executors with a pump
        layouts, final = plan_layout(plan, balance)
        t0 = time.perf_counter()
        results: list[list[ChunkResult]] = []
        try:
            for k, lay in enumerate(layouts):
                self._seq += 1
                tasks = [chunk_task(plan, k, r, lay, ids, self._seq, opts, 0,
                                    timeout_s=self.timeout_s, emulated=False,
                                    node_of=self.node_of)
                         for r in range(len(lay.group))]
                for t in tasks:
                    self.executors[t.instance].prepare(t)
                results.append(self._execute(tasks))
        except BaseException:
            self.release(plan.request_id)
            raise
        return prefill_result(plan, results, final, time.perf_counter() - t0, [0.0],
                              emulated=False)

    def _execute(self, tasks) -> list[ChunkResult]:
        out: list = [None] * len(tasks)
        errors: list = []

        def member(j: int) -> None:
            t = tasks[j]
            try:
                if self.model.device.type == "cuda":   # this thread's current device
                    torch.cuda.set_device(self.model.device.index or 0)
                out[j] = self.executors[t.instance].execute(t, self.links[t.instance])
            except Exception as e:  # noqa: BLE001 - raised below, with the instance
                errors.append((t.instance, e))

        _all(member, range(len(tasks)), self.timeout_s * 4)
        if errors:
            inst, err = errors[0]
            raise PrefillError(f"chunk {tasks[0].chunk_index} failed on instance {inst}: "
                               f"{type(err).__name__}: {err}") from err
        return out

    def kv(self, request_id: str, instance: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, K [L, n, Hkv, D], V) of the request held on ``instance``."""
        return self.stores[instance].export(request_id)

    def release(self, request_id: str) -> None:
        for ex in self.executors:
            ex.abort(request_id)


def _all(fn, args, timeout_s: float) -> None:
    threads = [threading.Thread(target=fn, args=(a,), daemon=True) for a in args]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise PrefillError(f"local prefill members still running after {timeout_s:.0f}s")
