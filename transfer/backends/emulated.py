"""EMULATION backend: KV writes take the paper's time and move no payload.

An emulated prefill worker streams KV of a tiny wire geometry (``head_dim`` 1, see
``actors/decode/emulated.py``) so that handshakes, grants, piece notices and the receive
manager's bookkeeping stay real while the bytes stay small. This agent times each write as the
paper's bytes on the paper's link::

    duration = wire_bytes × bytes_per_wire_byte / bandwidth          (seconds)

Writes on one agent queue behind each other (one link per sender, as one NIC per GPU in the
paper's cluster). A write reports ``proc`` until its emulated end, then ``done``; only then is
its notification sent, so the receiver places a piece no earlier than its bytes would have
landed. No bytes are copied: receive regions may be meta tensors.

Notifications cross processes through NIXL's notification channel over UCX (the channel that
carries real piece notices); without NIXL, or with ``transport="inproc"``, they reach agents of
the same process only (tests).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import torch

from tetris.transfer.backends.base import BackendCapabilities, TransferAgent, WriteStatus
from tetris.transfer.messages import AgentInfo, RegionDesc

__all__ = ["EmulatedAgent", "write_seconds"]

_LOCAL: dict[str, "EmulatedAgent"] = {}   # in-process transport: name -> agent
_LOCK = threading.Lock()
_ADDR = itertools.count(1 << 20)          # region ids: no memory is registered


def write_seconds(wire_bytes: int, bytes_per_wire_byte: float, bandwidth: float) -> float:
    """Emulated duration of one write: the paper's bytes over the link's bandwidth."""
    return wire_bytes * bytes_per_wire_byte / bandwidth


class _Write:
    __slots__ = ("due", "peer", "notif", "state")

    def __init__(self, due: float, peer: str, notif: bytes) -> None:
        self.due, self.peer, self.notif = due, peer, notif
        self.state: WriteStatus = "proc"


class EmulatedAgent(TransferAgent):
    backend = "emulated"
    capabilities = BackendCapabilities(cross_process=True, device_memory=False)

    def __init__(self, name: str, *, bandwidth: float, bytes_per_wire_byte: float,
                 transport: str = "auto", clock: Callable[[], float] = time.monotonic) -> None:
        if bandwidth <= 0 or bytes_per_wire_byte <= 0:
            raise ValueError("emulated bandwidth and bytes per wire byte must be positive")
        self.name = name
        self.bandwidth = bandwidth
        self.bytes_per_wire_byte = bytes_per_wire_byte
        self.clock = clock
        self._nixl = _nixl_agent(name) if transport in ("auto", "nixl") else None
        if self._nixl is None and transport == "nixl":
            raise RuntimeError("the emulated backend's NIXL transport is not available")
        if self._nixl is None:
            self.capabilities = BackendCapabilities(cross_process=False, device_memory=False)
            with _LOCK:
                if name in _LOCAL:
                    raise ValueError(f"an emulated transfer agent named {name!r} already exists")
                _LOCAL[name] = self
        self._inbox: list[tuple[str, bytes]] = []
        self._regions: dict[int, int] = {}     # data_ptr (or id) -> region address
        self._peers: dict[str, bytes] = {}      # name -> the metadata it was added with
        self._link_free = 0.0                  # when this agent's link is next idle
        self.bytes_written = 0                 # wire bytes (the paper's: × bytes_per_wire_byte)

    def info(self) -> AgentInfo:
        meta = self._nixl.get_agent_metadata() if self._nixl is not None else b""
        return AgentInfo(name=self.name, backend=self.backend, metadata=meta)

    def add_peer(self, info: AgentInfo) -> None:
        if info.backend != self.backend:
            raise ValueError(f"peer {info.name!r} uses backend {info.backend!r}, this agent {self.backend!r}")
        known = self._peers.get(info.name)
        if known == info.metadata:
            return
        if known is not None:   # the peer was replaced (a restarted process): forget the old one
            self.remove_peer(info.name)
        if self._nixl is not None:
            self._nixl.add_remote_agent(info.metadata)
        self._peers[info.name] = info.metadata

    def remove_peer(self, name: str) -> None:
        if name in self._peers and self._nixl is not None:
            self._nixl.remove_remote_agent(name)
        self._peers.pop(name, None)

    def register(self, buffer: torch.Tensor) -> RegionDesc:
        # Meta tensors (no storage) are welcome: nothing is ever written into a region.
        key = id(buffer) if buffer.is_meta else buffer.data_ptr()
        addr = self._regions.setdefault(key, next(_ADDR))
        return RegionDesc(agent=self.name, addr=addr, nbytes=buffer.numel() * buffer.element_size())

    def deregister(self, buffer: torch.Tensor) -> None:
        self._regions.pop(id(buffer) if buffer.is_meta else buffer.data_ptr(), None)

    def write(self, src: torch.Tensor, dst: RegionDesc, dst_offset: int, notif: bytes) -> object:
        if dst.agent not in self._peers:
            raise ValueError(f"agent {self.name!r} does not know peer {dst.agent!r}")
        nbytes = src.numel() * src.element_size()
        if dst_offset + nbytes > dst.nbytes:
            raise ValueError(f"write of {nbytes} B at offset {dst_offset} overflows a {dst.nbytes} B region")
        start = max(self.clock(), self._link_free)
        self._link_free = start + write_seconds(nbytes, self.bytes_per_wire_byte, self.bandwidth)
        self.bytes_written += nbytes
        return _Write(self._link_free, dst.agent, notif)

    def status(self, handle: object) -> WriteStatus:
        assert isinstance(handle, _Write)
        if handle.state == "proc" and self.clock() >= handle.due:
            handle.state = self._notify(handle.peer, handle.notif)
        return handle.state

    def _notify(self, peer: str, notif: bytes) -> WriteStatus:
        if self._nixl is not None:
            self._nixl.send_notif(peer, notif)
            return "done"
        with _LOCK:
            target = _LOCAL.get(peer)
            if target is None:
                return "err"
            target._inbox.append((self.name, notif))
        return "done"

    def release(self, handle: object) -> None:
        pass

    def notifications(self) -> list[tuple[str, bytes]]:
        if self._nixl is not None:
            out: list[tuple[str, bytes]] = []
            for peer, msgs in sorted(self._nixl.get_new_notifs().items()):
                name = peer.decode() if isinstance(peer, bytes) else peer
                out.extend((name, m) for m in msgs)
            return out
        with _LOCK:
            out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        for name in sorted(self._peers):
            self.remove_peer(name)
        self._regions.clear()
        with _LOCK:
            if _LOCAL.get(self.name) is self:
                del _LOCAL[self.name]


def _nixl_agent(name: str):
    """A NIXL agent with UCX for notifications only, or None when NIXL cannot start here."""
    from tetris.transfer.backends import nixl_unavailable_reason

    if nixl_unavailable_reason() is not None:
        return None
    from tetris.transfer.backends.nixl_ucx import new_nixl_agent

    try:
        agent = new_nixl_agent(name)   # a progress thread that sleeps while idle
    except Exception:  # noqa: BLE001 - fall back to the in-process transport
        return None
    return agent if "UCX" in agent.backends else None
