"""In-process backend: agents of one Python process write into each other's tensors.

For unit tests and single-process tools. A write is queued at ``write`` and performed at the
first ``status`` call, so that tests see the same proc -> done sequence as with NIXL.
"""

from __future__ import annotations

import threading

import torch

from tetris.transfer.backends.base import BackendCapabilities, TransferAgent, WriteStatus
from tetris.transfer.messages import AgentInfo, RegionDesc

__all__ = ["InProcAgent"]

# name -> agent, shared by every agent of this process; the lock guards it and the queues
# because Ray threaded actors may poll from several threads.
_AGENTS: dict[str, "InProcAgent"] = {}
_LOCK = threading.Lock()


class _Write:
    def __init__(self, src: torch.Tensor, dst: RegionDesc, dst_offset: int, notif: bytes) -> None:
        self.src, self.dst, self.dst_offset, self.notif = src, dst, dst_offset, notif
        self.state: WriteStatus = "proc"


class InProcAgent(TransferAgent):
    backend = "inproc"
    capabilities = BackendCapabilities(cross_process=False, device_memory=True)

    def __init__(self, name: str) -> None:
        with _LOCK:
            if name in _AGENTS:
                raise ValueError(f"an in-process transfer agent named {name!r} already exists")
            _AGENTS[name] = self
        self.name = name
        self._regions: dict[int, torch.Tensor] = {}   # addr -> flat uint8 view
        self._peers: set[str] = set()
        self._inbox: list[tuple[str, bytes]] = []

    def info(self) -> AgentInfo:
        return AgentInfo(name=self.name, backend=self.backend, metadata=b"")

    def add_peer(self, info: AgentInfo) -> None:
        if info.backend != self.backend:
            raise ValueError(f"peer {info.name!r} uses backend {info.backend!r}, this agent {self.backend!r}")
        self._peers.add(info.name)

    def remove_peer(self, name: str) -> None:
        self._peers.discard(name)

    def register(self, buffer: torch.Tensor) -> RegionDesc:
        if not buffer.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        flat = buffer.view(-1).view(torch.uint8)
        self._regions[buffer.data_ptr()] = flat
        return RegionDesc(agent=self.name, addr=buffer.data_ptr(), nbytes=flat.numel(), mem="INPROC")

    def deregister(self, buffer: torch.Tensor) -> None:
        self._regions.pop(buffer.data_ptr(), None)

    def write(self, src: torch.Tensor, dst: RegionDesc, dst_offset: int, notif: bytes) -> object:
        if dst.agent not in self._peers:
            raise ValueError(f"agent {self.name!r} does not know peer {dst.agent!r}")
        if not src.is_contiguous():
            raise ValueError("write needs a contiguous source tensor")
        return _Write(src, dst, dst_offset, notif)

    def status(self, handle: object) -> WriteStatus:
        assert isinstance(handle, _Write)
        if handle.state == "proc":
            handle.state = self._perform(handle)
        return handle.state

    def _perform(self, w: _Write) -> WriteStatus:
        with _LOCK:
            peer = _AGENTS.get(w.dst.agent)
            region = None if peer is None else peer._regions.get(w.dst.addr)
            nbytes = w.src.numel() * w.src.element_size()
            if region is None or w.dst_offset + nbytes > region.numel():
                return "err"
            region[w.dst_offset:w.dst_offset + nbytes].copy_(w.src.reshape(-1).view(torch.uint8))
            peer._inbox.append((self.name, w.notif))
        return "done"

    def release(self, handle: object) -> None:
        pass

    def notifications(self) -> list[tuple[str, bytes]]:
        with _LOCK:
            out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        with _LOCK:
            if _AGENTS.get(self.name) is self:
                del _AGENTS[self.name]
        self._regions.clear()
        self._peers.clear()
