"""NIXL backend over UCX: one NIXL agent per manager, writes with notifications.

CPU tensors register as DRAM, CUDA tensors as VRAM (GPUDirect where UCX supports it). Agent
metadata (``get_agent_metadata``) travels through Ray as ``AgentInfo.metadata``; the receiver
never needs the sender's metadata because the sender initiates every write.
"""

from __future__ import annotations

import logging

import torch

from tetris.transfer.backends.base import BackendCapabilities, TransferAgent, WriteStatus
from tetris.transfer.messages import AgentInfo, RegionDesc

__all__ = ["NixlAgent"]

log = logging.getLogger(__name__)

_STATUS: dict[str, WriteStatus] = {"PROC": "proc", "DONE": "done", "ERR": "err"}


class NixlAgent(TransferAgent):
    backend = "nixl-ucx"
    capabilities = BackendCapabilities(cross_process=True, device_memory=True)

    def __init__(self, name: str) -> None:
        # Imported here so that a missing nixl install is caught by the backend selection.
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise RuntimeError(f"NIXL agent {name!r} has no UCX backend (plugins: {self._agent.plugin_list})")
        self._registered: dict[int, object] = {}   # data_ptr -> nixlRegDList
        self._peers: dict[str, bytes] = {}      # name -> the metadata it was added with

    def info(self) -> AgentInfo:
        return AgentInfo(name=self.name, backend=self.backend, metadata=self._agent.get_agent_metadata())

    def add_peer(self, info: AgentInfo) -> None:
        if info.backend != self.backend:
            raise ValueError(f"peer {info.name!r} uses backend {info.backend!r}, this agent {self.backend!r}")
        known = self._peers.get(info.name)
        if known == info.metadata:
            return
        if known is not None:   # the peer was replaced (a restarted process): forget the old one
            self.remove_peer(info.name)
        self._agent.add_remote_agent(info.metadata)
        self._peers[info.name] = info.metadata

    def remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._agent.remove_remote_agent(name)
            del self._peers[name]

    def register(self, buffer: torch.Tensor) -> RegionDesc:
        if not buffer.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        if buffer.data_ptr() not in self._registered:
            self._registered[buffer.data_ptr()] = self._agent.register_memory(buffer)
        on_gpu = buffer.device.type == "cuda"
        return RegionDesc(agent=self.name, addr=buffer.data_ptr(),
                          nbytes=buffer.numel() * buffer.element_size(),
                          device_id=buffer.get_device() if on_gpu else 0,
                          mem="VRAM" if on_gpu else "DRAM")

    def deregister(self, buffer: torch.Tensor) -> None:
        descs = self._registered.pop(buffer.data_ptr(), None)
        if descs is not None:
            self._agent.deregister_memory(descs)

    def write(self, src: torch.Tensor, dst: RegionDesc, dst_offset: int, notif: bytes) -> object:
        if dst.agent not in self._peers:
            raise ValueError(f"agent {self.name!r} does not know peer {dst.agent!r}")
        if not src.is_contiguous():
            raise ValueError("write needs a contiguous source tensor")
        nbytes = src.numel() * src.element_size()
        if dst_offset + nbytes > dst.nbytes:
            raise ValueError(f"write of {nbytes} B at offset {dst_offset} overflows a {dst.nbytes} B region")
        on_gpu = src.device.type == "cuda"
        local = self._agent.get_xfer_descs([(src.data_ptr(), nbytes, src.get_device() if on_gpu else 0)],
                                           "VRAM" if on_gpu else "DRAM")
        remote = self._agent.get_xfer_descs([(dst.addr + dst_offset, nbytes, dst.device_id)], dst.mem)
        handle = self._agent.initialize_xfer("WRITE", local, remote, dst.agent, notif)
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL could not post a write of {nbytes} B to {dst.agent!r}")
        return handle

    def status(self, handle: object) -> WriteStatus:
        return _STATUS[self._agent.check_xfer_state(handle)]

    def release(self, handle: object) -> None:
        self._agent.release_xfer_handle(handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for peer, msgs in sorted(self._agent.get_new_notifs().items()):
            name = peer.decode() if isinstance(peer, bytes) else peer
            out.extend((name, m) for m in msgs)
        return out

    def close(self) -> None:
        for ptr in sorted(self._registered):
            self._agent.deregister_memory(self._registered[ptr])
        self._registered.clear()
        for name in sorted(self._peers):
            self._agent.remove_remote_agent(name)
        self._peers.clear()
