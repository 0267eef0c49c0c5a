"""The data-plane interface every transfer backend implements (one agent per manager).

An agent registers buffers, writes a local contiguous tensor into a peer's registered region
with a notification that reaches the peer only after the bytes, and is polled, never blocked on.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Literal

import torch

from tetris.transfer.messages import AgentInfo, RegionDesc

__all__ = ["TransferAgent", "WriteStatus", "BackendCapabilities"]

WriteStatus = Literal["proc", "done", "err"]


class BackendCapabilities:
    """What a backend can do; callers branch on these flags, never on the agent's type."""

    def __init__(self, *, cross_process: bool, device_memory: bool,
                 scattered_writes: bool = False) -> None:
        self.cross_process = cross_process
        self.device_memory = device_memory
        self.scattered_writes = scattered_writes   # ``write_descs``: direct writes need it

    def __repr__(self) -> str:
        return (f"BackendCapabilities(cross_process={self.cross_process}, device_memory="
                f"{self.device_memory}, scattered_writes={self.scattered_writes})")


class TransferAgent(abc.ABC):
    name: str
    backend: str
    capabilities: BackendCapabilities

    @abc.abstractmethod
    def info(self) -> AgentInfo:
        """Metadata a peer passes to ``add_peer`` (sent through Ray by the owners)."""

    @abc.abstractmethod
    def add_peer(self, info: AgentInfo) -> None:
        """Make ``info``'s agent reachable. Idempotent; a known name with new metadata (its
        process was replaced) replaces the old peer."""

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None: ...

    @abc.abstractmethod
    def register(self, buffer: torch.Tensor) -> RegionDesc:
        """Register a contiguous tensor; the returned region may be handed to peers."""

    @abc.abstractmethod
    def deregister(self, buffer: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def write(self, src: torch.Tensor, dst: RegionDesc, dst_offset: int, notif: bytes) -> object:
        """Start writing registered contiguous ``src`` to ``dst`` at ``dst_offset``; returns a handle."""

    def write_descs(self, src: torch.Tensor, descs: Sequence[tuple[int, RegionDesc, int, int]],
                    notif: bytes) -> object:
        """Start one write of several ranges of registered contiguous ``src``: each descriptor
        is (source byte offset, peer region, destination byte offset, bytes), every region of
        one peer; ``notif`` reaches the peer after all of them (direct writes, transfer/direct.py).
        Only backends whose capabilities say ``scattered_writes``."""
        raise NotImplementedError(f"the {self.backend} transfer backend writes one range at a time")

    @abc.abstractmethod
    def status(self, handle: object) -> WriteStatus: ...

    @abc.abstractmethod
    def release(self, handle: object) -> None: ...

    @abc.abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """New ``(peer agent name, message)`` pairs since the last call, in arrival order."""

    def close(self) -> None:
        """Drop all registrations and peers (idempotent)."""
