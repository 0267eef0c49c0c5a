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
    """One write: ``parts`` are (source bytes, destination offset) into region ``dst``'s agent."""

    def __init__(self, parts: list[tuple[torch.Tensor, RegionDesc, int]], notif: bytes) -> None:
        self.parts, self.notif = parts, notif
        self.state: WriteStatus = "proc"


class InProcAgent(TransferAgent):
    backend = "inproc"
    capabilities = BackendCapabilities(cross_process=False, device_memory=True,
                                       scattered_writes=True)

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
        return _Write([(src.reshape(-1).view(torch.uint8), dst, dst_offset)], notif)

    def write_descs(self, src: torch.Tensor, descs, notif: bytes) -> object:
        if not src.is_contiguous():
            raise ValueError("write needs a contiguous source tensor")
        flat = src.reshape(-1).view(torch.uint8)
        if len({d[1].agent for d in descs}) > 1:
            raise ValueError("one write goes to one peer")
        for _, region, _, _ in descs:
            if region.agent not in self._peers:
                raise ValueError(f"agent {self.name!r} does not know peer {region.agent!r}")
        return _Write([(flat[off:off + n], region, dst_off) for off, region, dst_off, n in descs],
                      notif)

    def status(self, handle: object) -> WriteStatus:
        assert isinstance(handle, _Write)
        if handle.state == "proc":
            handle.state = self._perform(handle)
        return handle.state

    def _perform(self, w: _Write) -> WriteStatus:
        with _LOCK:
            peer = None
            targets = []
            for src, dst, offset in w.parts:
                peer = _AGENTS.get(dst.agent)
                region = None if peer is None else peer._regions.get(dst.addr)
                if region is None or offset + src.numel() > region.numel():
                    return "err"
                targets.append((region[offset:offset + src.numel()], src))
            for target, src in targets:
                target.copy_(src)
            if peer is not None:
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
