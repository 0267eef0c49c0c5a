"""Generations of the prefill pool's gloo world: a new one forms while chunks run on the old.

A gloo world counts every worker, so a dead worker's replacement (or a ring whose timed-out
connections gloo closed for good) needs the world formed again. One world made with
``init_process_group`` can only be torn down and made again by every worker at once, so the
pool used to stop: new chunks held, running ones waited for (up to a long prompt's whole
prefill), then everyone re-joined. Here each world is a *generation*: its own store (on a
fresh port, served by instance 0's worker) and its own process group (gloo or NCCL), joined by every
worker on a thread beside the one that runs chunks. A chunk names the generation its members
use (``ChunkTask.world``); the pool starts new chunks on the newest one as soon as every worker
has joined it, while chunks already running finish on theirs, and drops a generation once no
chunk uses it. A dead rank in an old generation matters to no one: only the pairs a ring uses
carry traffic.

Each generation's backend, NCCL or gloo, is chosen by ``actors/collectives.py`` from every
member's device, gathered through the generation's store (``World.backend`` says which).

``DefaultWorld`` sends on the process's default group instead (a world made with
``init_process_group``), for code that runs outside the pool.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["World", "DefaultWorld", "PeerLink", "free_port"]


class PeerLink:
    """What a ring or a cache balancer needs from a world: point-to-point sends and receives
    by world rank (the prefill instance), each returning a work to ``wait`` on."""

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        raise NotImplementedError

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        raise NotImplementedError

    def exchange(self, sends, recvs, tag: int) -> list:
        """Post one step's sends and receives (lists of ``(tensor, peer)``) together; the works
        to wait on. gloo tells messages apart by tag, so any order does; an NCCL link orders
        them (``collectives.NcclLink``)."""
        return ([self.isend(t, p, tag) for t, p in sends]
                + [self.irecv(t, p, tag) for t, p in recvs])


class DefaultWorld(PeerLink):
    """The process's default group (``torch.distributed.init_process_group``)."""

    def isend(self, tensor, peer, tag):
        return dist.isend(tensor, peer, tag=tag)

    def irecv(self, tensor, peer, tag):
        return dist.irecv(tensor, peer, tag=tag)


class World(PeerLink):
    """Generation ``generation`` of the pool's world, as seen by ``rank``.

    Every member constructs it at the same time (the full mesh connects in the constructor,
    blocking until all ``size`` ranks have joined or ``timeout_s`` passes); rank 0 serves the
    store at ``host:port``. ``device`` is where this member computes (default: this host's
    CPU) and ``nccl`` whether it could use NCCL (default: ``collectives.nccl_available()``);
    the backend follows from every member's (``collectives.agree_backend``), and CUDA tensors
    on a gloo world are staged through host memory (``collectives.group_link``).
    """

    def __init__(self, generation: int, host: str, port: int, rank: int, size: int,
                 timeout_s: float, device=None, nccl: bool | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a world of {size}")
        self.generation = generation
        self.rank = rank
        self.size = size
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
        self._join(self._store, timeout, device, nccl)

    def _join(self, store, timeout: timedelta, device, nccl: bool | None) -> None:
        """Agree on the backend through ``store`` and connect the group (every member at once;
        ``tp_groups.SliceWorld`` joins through a prefix of a shared store)."""
        # imported here: collectives builds on PeerLink, defined above
        from tetris.actors import collectives

        rank, size = self.rank, self.size
        me = device or collectives.rank_device("cpu")
        able = collectives.nccl_available() if nccl is None else nccl
        self.backend = collectives.agree_backend(store, rank, size, me, able)
        self._group = collectives.process_group(store, rank, size, self.backend, timeout)
        self._link = collectives.group_link(self._group, rank, self.backend, me.device)

    def isend(self, tensor, peer, tag):
        return self._link.isend(tensor, peer, tag)

    def irecv(self, tensor, peer, tag):
        return self._link.irecv(tensor, peer, tag)

    def exchange(self, sends, recvs, tag):
        return self._link.exchange(sends, recvs, tag)

    def close(self) -> None:
        """Drop the group's connections and the store (no chunk may be using it)."""
        self._group = None
        self._link = None
        self._store = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (the OS picks it); the world's store listens there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
