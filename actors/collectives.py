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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from tetris.actors.prefill.world import PeerLink

__all__ = ["Backend", "RankDevice", "choose_backend", "nccl_available", "peer_link",
           "StagedLink"]

Backend = Literal["nccl", "gloo"]


class RankDevice(NamedTuple):
    """Where one rank computes: its node and its torch device ("cpu", "cuda:0", ...)."""

    node: str
    device: str


def nccl_available() -> bool:
    """Whether this process could form an NCCL group (a CUDA build with NCCL and a GPU)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available())


def choose_backend(ranks: Sequence[RankDevice], nccl: bool) -> Backend:
    """NCCL iff ``nccl`` (see ``nccl_available``) and every rank owns a distinct CUDA device."""
    if not ranks:
        raise ValueError("a group needs at least one rank")
    on_cuda = all(torch.device(r.device).type == "cuda" for r in ranks)
    distinct = len({(r.node, _canonical(r.device)) for r in ranks}) == len(ranks)
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
