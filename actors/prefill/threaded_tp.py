"""One TP rank of a pool of TP > 1 instances, its instances as threads of one process.

``ThreadedPool`` runs TP-1 instances on threads sharing one model. With TP > 1, process ``t``
is TP rank ``t`` of every instance: its threads are the instances' ranks ``t``, its gloo world
among them is head slice ``t``'s world (the TP ranks ``t`` of the instances, as
``tp_groups.SliceWorld`` ranks them by instance), and instance ``i``'s model shard is built on
``tp_groups[i]``, the instance's own TP group over the ``T`` processes (its row-parallel
all-reduces, and SP-TP's sum over the slices, sptp.py). Every process builds the same pool, its
TP groups created in the same order, and runs the same plans: the ranks of an instance then
meet at the same all-reduces. For exactness checks and benchmarks without Ray
(tests/actors/prefill/test_sptp_tp.py, benchmarks/bench_sptp_tp.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from tetris.actors.prefill.executor import ModelExecutor
from tetris.actors.prefill.threaded import ThreadedPool

from tetris.model.loader import load_model

__all__ = ["ThreadedTpRank", "instance_tp_groups"]


def instance_tp_groups(num_instances: int) -> list:
    """One TP group per instance, each over every process of the default group (call it on
    every process, in the same order)."""
    ranks = list(range(dist.get_world_size()))
    return [dist.new_group(ranks) for _ in range(num_instances)]


class ThreadedTpRank(ThreadedPool):
    """This process's TP rank of ``len(tp_groups)`` instances of ``model_cfg``."""

    def __init__(self, model_cfg, tp_groups: Sequence, *, num_blocks: int, block_size: int,
                 timeout_s: float = 60.0, node_of: Sequence[int] = ()) -> None:
        self.models = [load_model(model_cfg, tp_group=g)[0] for g in tp_groups]
        super().__init__(self.models[0], len(self.models), num_blocks=num_blocks,
                         block_size=block_size, timeout_s=timeout_s, node_of=node_of)
        # each instance's executor on its own shard (the base class shares one model)
        self.executors = [ModelExecutor(m, s) for m, s in zip(self.models, self.stores)]
