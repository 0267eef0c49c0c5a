"""The one place that chooses how ranks talk: NCCL or gloo, and whether tensors are staged.

Prefill worlds (ring P2P, cache balancing) and decode TP groups (all-reduce) are formed by
whoever owns them, but the backend is chosen here, from what each rank runs on:

- **NCCL** when every rank owns a CUDA device of its own (NCCL refuses two ranks on one GPU)
  and this torch build has NCCL;
- **gloo** otherwise: CPU ranks, ranks that share a GPU (fractional GPUs, as the tests place
  several actors on one device), or a build without NCCL.

gloo moves CPU tensors only for point-to-point traffic, so a gloo link whose ranks compute on
CUDA is wrapped in a ``StagedLink``: each send copies the tensor to host memory first and each
receive lands in host memory and is copied to the device once it completes. Nothing above this
module knows which of the three paths it runs on.

Every group is formed here too, so every rank makes the same choice: each rank writes its own
``RankDevice`` and NCCL availability to the group's store, reads everyone's, and calls
``choose_backend`` on the same list (``agree_backend``). The prefill pool's world generations
(``World``) and the decode instance's TP world (``form_tp_group``) both go through it.

NCCL matches point-to-point operations between two ranks in the order they are posted and
ignores tags. The prefill traffic allows that: every member of a chunk posts its ring steps and
its balancing moves in the same program order (layer by layer, step by step, the moves in the
plan's order), and a worker runs its chunks one at a time in commit order, so the k-th send
from a to b always meets the k-th receive b posts from a. What order alone cannot prevent is a
deadlock when the sends and receives of one step between the same two ranks queue on one
stream (a ring of two, or balancing both ways): ``NcclLink.exchange`` posts a step's
operations sorted by (pair, direction), the same order on both ends of every pair.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist

from tetris.actors.prefill.world import PeerLink
from tetris.actors.timer_slack import loose_timers

__all__ = ["Backend", "RankDevice", "choose_backend", "nccl_available", "peer_link",
           "StagedLink", "rank_device", "agree_backend", "process_group", "form_tp_group",
           "GroupLink", "group_link", "NcclLink", "pair_order"]

Backend = Literal["nccl", "gloo"]


class RankDevice(NamedTuple):
    """Where one rank computes: its node and its torch device ("cpu", "cuda:0", ...); ``gpu``,
    when known, names the physical GPU (its UUID): two actors that Ray gave different GPUs
    both see theirs as "cuda:0"."""

    node: str
    device: str
    gpu: str = ""


def rank_device(device: str | torch.device) -> RankDevice:
    """This process's ``RankDevice`` when it computes on ``device``."""
    d = torch.device(device)
    node = socket.gethostname()
    if d.type != "cuda":
        return RankDevice(node, d.type)
    index = d.index if d.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return RankDevice(node, f"cuda:{index}", "" if uuid is None else str(uuid))


def nccl_available() -> bool:
    """Whether this process could form an NCCL group (a CUDA build with NCCL and a GPU)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available())


def choose_backend(ranks: Sequence[RankDevice], nccl: bool) -> Backend:
    """NCCL iff ``nccl`` (see ``nccl_available``) and every rank owns a distinct CUDA device."""
    if not ranks:
        raise ValueError("a group needs at least one rank")
    on_cuda = all(torch.device(r.device).type == "cuda" for r in ranks)
    distinct = len({(r.node, r.gpu or _canonical(r.device)) for r in ranks}) == len(ranks)
    return "nccl" if nccl and on_cuda and distinct else "gloo"


def _canonical(device: str) -> str:
    d = torch.device(device)
    return f"{d.type}:{d.index or 0}" if d.type == "cuda" else d.type


def peer_link(link: PeerLink, backend: Backend, device: str | torch.device) -> PeerLink:
    """``link`` as the ring and the balancer should use it on ``device``: staged through host
    memory when the backend is gloo and the tensors live on CUDA, as is otherwise."""
    if backend == "gloo" and torch.device(device).type == "cuda":
        return StagedLink(link)
    return link


class _Done:
    """The work of a send whose host copy was handed to gloo: waits on gloo's work."""

    def __init__(self, inner, keep: torch.Tensor | None = None) -> None:
        self.inner = inner
        self.keep = keep   # the host copy stays alive until gloo is done with it

    def wait(self, timeout=None) -> bool:
        return bool(self.inner.wait(timeout) if timeout is not None else self.inner.wait())


class _StagedRecv(_Done):
    """A receive into a host buffer; the device tensor is filled when the wait succeeds."""

    def __init__(self, inner, host: torch.Tensor, dst: torch.Tensor) -> None:
        super().__init__(inner)
        self.host, self.dst = host, dst

    def wait(self, timeout=None) -> bool:
        ok = super().wait(timeout)
        if ok and self.host is not None:
            self.dst.copy_(self.host, non_blocking=False)
            self.host = None   # copied once, even if waited on again
        return ok


class StagedLink(PeerLink):
    """A gloo ``PeerLink`` for CUDA tensors: host copies on the way out and in."""

    def __init__(self, link: PeerLink) -> None:
        self.link = link

    def isend(self, tensor, peer, tag):
        if tensor.device.type == "cpu":
            return self.link.isend(tensor, peer, tag)
        host = tensor.detach().to("cpu")   # synchronous: the bytes are final before gloo reads
        return _Done(self.link.isend(host, peer, tag), host)

    def irecv(self, tensor, peer, tag):
        if tensor.device.type == "cpu":
            return self.link.irecv(tensor, peer, tag)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        return _StagedRecv(self.link.irecv(host, peer, tag), host, tensor)


# -- forming groups: every rank reads every rank's device, so all choose alike ----------------
def agree_backend(store, rank: int, size: int, me: RankDevice, nccl: bool,
                  key: str = "tetris/rank_device") -> Backend:
    """The backend of a group of ``size`` ranks, the same on every rank: each writes ``me`` and
    its own ``nccl`` (see ``nccl_available``) to ``store`` and reads all of them (the store's
    ``get`` waits for a rank that has not written yet). NCCL needs it on every rank."""
    store.set(f"{key}/{rank}", json.dumps([me.node, me.device, me.gpu, bool(nccl)]))
    ranks, able = [], []
    for r in range(size):
        node, device, gpu, ok = json.loads(store.get(f"{key}/{r}"))
        ranks.append(RankDevice(node, device, gpu))
        able.append(ok)
    return choose_backend(ranks, all(able))


def process_group(store, rank: int, size: int, backend: Backend, timeout: timedelta):
    """A process group of ``backend`` over ``store`` (not the default group)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    with loose_timers():   # its transport thread's idle 10 ms ticks (actors/timer_slack.py)
        return dist.ProcessGroupGloo(store, rank, size, timeout)


def form_tp_group(host: str, port: int, rank: int, size: int, timeout_s: float,
                  me: RankDevice, nccl: bool | None = None) -> Backend:
    """Form the process's default group for a decode instance's TP ranks (the model's
    all-reduce runs on it), its store at ``host:port`` served by rank 0; returns its backend."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
    backend = agree_backend(store, rank, size, me, nccl_available() if nccl is None else nccl)
    with loose_timers() if backend == "gloo" else contextlib.nullcontext():
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return backend


# -- NCCL point-to-point ------------------------------------------------------------------------
def pair_order(rank: int, sends: Sequence[tuple[torch.Tensor, int]],
               recvs: Sequence[tuple[torch.Tensor, int]]) -> list[tuple[str, torch.Tensor, int]]:
    """One step's operations ("send" | "recv", tensor, peer) in the order both ends of every
    pair post them: by pair, then the lower rank's sends before the higher rank's, and within
    one direction in the caller's order (which both ends share). With every rank posting in
    this one global order, the first unfinished operation anywhere is first on both of its
    ranks, so a stream that runs them one at a time cannot deadlock."""
    def key(peer: int, lower_sends: bool):
        return (min(rank, peer), max(rank, peer), 0 if lower_sends else 1)

    ops = [(key(p, rank < p), "send", t, p) for t, p in sends]
    ops += [(key(p, p < rank), "recv", t, p) for t, p in recvs]
    ops.sort(key=lambda op: op[0])   # stable: the caller's order within a direction
    return [(kind, t, p) for _k, kind, t, p in ops]


class GroupLink(PeerLink):
    """Point-to-point on a process group that is not the default one (a world generation)."""

    def __init__(self, group) -> None:
        self.group = group

    def isend(self, tensor, peer, tag):
        return self.group.send([tensor], peer, tag)

    def irecv(self, tensor, peer, tag):
        return self.group.recv([tensor], peer, tag)


def group_link(group, rank: int, backend: Backend, device: str | torch.device) -> PeerLink:
    """How a member on ``device`` talks on ``group``: NCCL in pair order from a side stream,
    gloo as is for CPU tensors, gloo staged through host memory for CUDA ones."""
    if backend == "nccl":
        return NcclLink(group, rank)
    return peer_link(GroupLink(group), backend, device)


class NcclLink(GroupLink):
    """Point-to-point on an NCCL group (tags are ignored: see the module's note on order).

    A step's operations are posted from a side stream that first waits for the compute
    stream (the tensors to send are final there); the NCCL kernels then run beside the
    attention that follows, and a work's ``wait`` makes the caller's stream wait for it."""

    def __init__(self, group, rank: int) -> None:
        super().__init__(group)
        self.rank = rank
        self._stream: torch.cuda.Stream | None = None

    def exchange(self, sends, recvs, tag):
        ops = pair_order(self.rank, sends, recvs)
        if not ops:
            return []
        device = ops[0][1].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            return [self.isend(t, p, tag) if kind == "send" else self.irecv(t, p, tag)
                    for kind, t, p in ops]
