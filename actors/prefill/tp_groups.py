"""The groups and shares of a prefill instance with TP > 1, with no Ray in them (the actors that
form and drive them are ``tp.py``'s, whose docstring tells the whole design): the head-slice
worlds of a generation (``SliceWorld``), the instance's own TP group, which decode receivers
each TP rank streams to, and an instance's KV and transfer state put together from its ranks'.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from tetris.actors.collectives import form_tp_group, rank_device
from tetris.actors.prefill.world import World

__all__ = ["TP_GROUP_TIMEOUT_S", "SliceWorld", "check_streaming", "concat_heads",
           "join_instance_group", "merge_states", "own_receivers", "workers_per_instance"]

TP_GROUP_TIMEOUT_S = 600.0   # an instance's all-reduces: longer than any chunk's ring waits


class SliceWorld(World):
    """Head slice ``tp_rank``'s group of generation ``generation`` of the pool's world, as
    instance ``rank`` sees it: the TP ranks ``tp_rank`` of every instance, ranked by instance
    (the ring and the balancer address their peers as on a TP-1 ``World``), its backend agreed
    through ``actors/collectives.py`` from every member's ``device`` as a ``World``'s is.

    One store serves every slice of a generation (instance 0's leader hosts it at
    ``host:port``, the address the pool asks it for); each slice keys its rendezvous apart.
    """

    def __init__(self, generation: int, host: str, port: int, rank: int, size: int,
                 timeout_s: float, tp_rank: int, device=None, nccl: bool | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a world of {size}")
        self.generation = generation
        self.rank = rank
        self.size = size
        self.tp_rank = tp_rank
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, None, rank == 0 and tp_rank == 0,
                                    timeout=timeout, wait_for_workers=False)
        self._join(dist.PrefixStore(f"slice{tp_rank}/", self._store), timeout, device, nccl)


def join_instance_group(host: str, port: int, tp_rank: int, tp_size: int, device: str):
    """Form the instance's TP group as this process's default group, its backend agreed from
    every rank's ``device`` (``collectives.form_tp_group``); returns it."""
    if dist.is_initialized():
        dist.destroy_process_group()
    form_tp_group(host, port, tp_rank, tp_size, TP_GROUP_TIMEOUT_S, rank_device(device))
    return dist.group.WORLD


def workers_per_instance(prefill_cfg) -> int:
    """The TP ranks an instance runs as actors: ``tp_size`` for the real model, 1 for the
    emulated executor (its TP is only its latency profile's)."""
    return 1 if prefill_cfg.executor == "emulated" else prefill_cfg.tp_size


def own_receivers(receivers: tuple[int, ...], tp_rank: int, tp_size: int) -> tuple[int, ...]:
    """The receivers TP rank ``tp_rank`` of ``tp_size`` streams to: ``[t·R/T, (t+1)·R/T)``
    of the chunk's ``R`` (the ones whose KV heads lie in its slice)."""
    n = len(receivers)
    if n % tp_size:
        raise ValueError(f"a TP-{tp_size} prefill instance streams whole head slices: its "
                         f"{n} receivers {tuple(receivers)} must be a multiple of {tp_size}")
    k = n // tp_size
    return tuple(receivers[tp_rank * k:(tp_rank + 1) * k])


def check_streaming(deployment) -> None:
    """Refuse, when the pool's send side starts, a deployment whose decode instances have a
    number of receivers (TP ranks) that TP prefill instances cannot stream whole head slices
    to (``own_receivers``)."""
    from tetris.errors import ConfigError

    tp = workers_per_instance(deployment.prefill)
    dc = deployment.decode
    receivers = 1 if dc.executor == "emulated" else dc.tp_size
    if tp > 1 and receivers % tp:
        raise ConfigError(f"prefill.tp_size = {tp}: each prefill TP rank streams whole KV head "
                          f"slices, so a decode instance's {receivers} TP ranks (decode.tp_size)"
                          f" must be a multiple of {tp}")


def merge_states(states: list[dict]) -> dict:
    """An instance's ``transfer_state`` from its ranks' (counts added, failures listed)."""
    return {"shards": sum(s["shards"] for s in states),
            "unfinished": sum(s["unfinished"] for s in states),
            "sent": sum(s["sent"] for s in states),
            "failed": [f for s in states for f in s["failed"]]}


def concat_heads(parts: list[tuple]) -> tuple:
    """(positions, k, v) exported by each TP rank, in rank order -> the instance's
    (positions, k [L, n, Hkv, D], v): the ranks hold the same positions, heads in rank order."""
    pos = parts[0][0]
    for p, _k, _v in parts[1:]:
        if not torch.equal(p, pos):
            raise RuntimeError("the TP ranks of a prefill instance hold different positions")
    return (pos, torch.cat([k for _p, k, _v in parts], dim=2),
            torch.cat([v for _p, _k, v in parts], dim=2))
