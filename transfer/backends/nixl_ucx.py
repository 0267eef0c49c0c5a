"""NIXL backend over UCX: one NIXL agent per manager, writes with notifications.

CPU tensors register as DRAM, CUDA tensors as VRAM (GPUDirect where UCX supports it): the
memory type and the descriptors come from the tensor's device (``nixl_segment``), so on a GPU
the sender's staging buffer and the receiver's backend buffers are device memory and NIXL moves
KV from GPU to GPU with no host copy on either side. Agent
metadata (``get_agent_metadata``) travels through Ray as ``AgentInfo.metadata``; the receiver
never needs the sender's metadata because the sender initiates every write.

Each agent's UCX backend runs a progress thread that sleeps in ``poll()`` on the UCX workers'
event fds and wakes as soon as traffic arrives (or a stop is asked). Its timeout is the agent
config's ``pthrDelay``: NIXL keeps a periodic wake-up as a backstop for a fd that misses its
wake-up. nixl's Python ``nixl_agent`` hard-codes ``pthrDelay = 0``, which makes that ``poll()``
return at once, forever: the thread busy-polls (poll, epoll_wait, two reads per round, ~4000
rounds/s), a quarter of a core per agent and 80% of it system time, idle or not; every prefill
worker and decode rank has one. ``new_nixl_agent`` builds agents with a real timeout
(``PROGRESS_DELAY_MS``; ``TETRIS_NIXL_PROGRESS_DELAY_MS`` overrides it): traffic still wakes the
thread at once, an idle one wakes ``1000 / PROGRESS_DELAY_MS`` times a second.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch

from tetris.transfer.backends.base import BackendCapabilities, TransferAgent, WriteStatus
from tetris.transfer.messages import AgentInfo, RegionDesc

__all__ = ["NixlAgent", "new_nixl_agent", "nixl_segment", "PROGRESS_DELAY_MS"]

log = logging.getLogger(__name__)

# The progress thread's poll() timeout. Only a lost fd wake-up waits this long; an idle thread
# costs ~1000 / PROGRESS_DELAY_MS wake-ups a second (each a few tens of microseconds).
PROGRESS_DELAY_MS = 100.0

_BUILD_LOCK = threading.Lock()
_warned = False


def progress_delay_ms() -> float:
    raw = os.environ.get("TETRIS_NIXL_PROGRESS_DELAY_MS")
    if raw is None:
        return PROGRESS_DELAY_MS
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"TETRIS_NIXL_PROGRESS_DELAY_MS={raw!r} is not a number") from None
    if not value >= 0:
        raise ValueError(f"TETRIS_NIXL_PROGRESS_DELAY_MS={raw!r} must be >= 0")
    return value


def new_nixl_agent(name: str, delay_ms: float | None = None):
    """A ``nixl_agent`` with the UCX backend whose progress thread blocks in ``poll()`` for up
    to ``delay_ms`` (default ``progress_delay_ms()``) instead of spinning.

    nixl's Python wrapper offers no knob for it: it builds the binding's ``nixlAgentConfig``
    itself and sets ``pthrDelay = 0``. While this agent is built the wrapper's module sees a
    binding whose config class keeps our delay whatever it is set to (everything else is the
    real binding; other agents' calls meanwhile go through to it unchanged). Should a nixl
    release change that wrapper so that this fails, the agent is built as nixl builds it, with
    a WARNING (its progress thread busy-polls)."""
    from nixl._api import nixl_agent, nixl_agent_config

    delay_us = round(1000.0 * (progress_delay_ms() if delay_ms is None else delay_ms))
    config = nixl_agent_config(backends=["UCX"])
    api = sys.modules.get(nixl_agent.__module__)
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    prop = getattr(base, "pthrDelay", None) if base is not None else None
    if delay_us <= 0 or not isinstance(prop, property):
        if delay_us > 0:
            _warn_once("nixl's agent config has no pthrDelay property to set")
        return nixl_agent(name, config)

    class _Config(base):  # type: ignore[misc, valid-type]
        pthrDelay = property(prop.fget, lambda self, _value: prop.fset(self, delay_us))

    class _Binding:
        nixlAgentConfig = _Config

        def __getattr__(self, key: str):
            return getattr(bind, key)

    with _BUILD_LOCK:
        api.nixlBind = _Binding()
        try:
            return nixl_agent(name, config)
        except TypeError as exc:   # the binding refused the subclass: build it nixl's way
            _warn_once(f"{type(exc).__name__}: {exc}")
        finally:
            api.nixlBind = bind
    return nixl_agent(name, config)


def _warn_once(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("NIXL agents keep nixl's progress-thread delay of 0 (a busy-polling thread "
                    "per agent): %s", why)

_STATUS: dict[str, WriteStatus] = {"PROC": "proc", "DONE": "done", "ERR": "err"}


def nixl_segment(addr: int, nbytes: int, device: torch.device) -> tuple[str, int]:
    """(NIXL memory type, device id) of ``nbytes`` at ``addr`` on ``device``: "VRAM" on the
    tensor's own GPU for CUDA memory, "DRAM" (device 0) for host memory. Anything else has no
    NIXL segment here."""
    if nbytes < 0 or addr < 0:
        raise ValueError(f"a segment needs addr, nbytes >= 0, got {addr}, {nbytes}")
    if device.type == "cuda":
        return "VRAM", 0 if device.index is None else device.index
    if device.type == "cpu":
        return "DRAM", 0
    raise ValueError(f"NIXL cannot register memory on {device}")


def _segment_of(tensor: torch.Tensor) -> tuple[int, int, str, int]:
    """(addr, nbytes, memory type, device id) of a contiguous tensor."""
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be registered or written")
    addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    return (addr, nbytes, *nixl_segment(addr, nbytes, tensor.device))


class NixlAgent(TransferAgent):
    backend = "nixl-ucx"
    capabilities = BackendCapabilities(cross_process=True, device_memory=True,
                                       scattered_writes=True)

    def __init__(self, name: str) -> None:
        # (new_nixl_agent imports nixl: a missing install is caught by the backend selection)
        self.name = name
        self._agent = new_nixl_agent(name)
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
        addr, nbytes, mem, device_id = _segment_of(buffer)
        if addr not in self._registered:
            descs = self._agent.register_memory([(addr, nbytes, device_id, "")], mem)
            if descs is None:
                raise RuntimeError(f"NIXL agent {self.name!r} could not register {nbytes} B of {mem}")
            self._registered[addr] = descs
        return RegionDesc(agent=self.name, addr=addr, nbytes=nbytes, device_id=device_id, mem=mem)

    def deregister(self, buffer: torch.Tensor) -> None:
        descs = self._registered.pop(buffer.data_ptr(), None)
        if descs is not None:
            self._agent.deregister_memory(descs)

    def write(self, src: torch.Tensor, dst: RegionDesc, dst_offset: int, notif: bytes) -> object:
        if dst.agent not in self._peers:
            raise ValueError(f"agent {self.name!r} does not know peer {dst.agent!r}")
        addr, nbytes, mem, device_id = _segment_of(src)
        if dst_offset + nbytes > dst.nbytes:
            raise ValueError(f"write of {nbytes} B at offset {dst_offset} overflows a {dst.nbytes} B region")
        local = self._agent.get_xfer_descs([(addr, nbytes, device_id)], mem)
        remote = self._agent.get_xfer_descs([(dst.addr + dst_offset, nbytes, dst.device_id)], dst.mem)
        handle = self._agent.initialize_xfer("WRITE", local, remote, dst.agent, notif)
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL could not post a write of {nbytes} B to {dst.agent!r}")
        return handle

    def write_descs(self, src: torch.Tensor, descs, notif: bytes) -> object:
        """One NIXL transfer of several descriptor pairs (local range i -> remote range i); the
        notification follows all of them."""
        addr, nbytes, mem, device_id = _segment_of(src)
        peers = {d[1].agent for d in descs}
        if len(peers) != 1 or len({d[1].mem for d in descs}) != 1:
            raise ValueError(f"one write goes to one peer's memory of one type, got {sorted(peers)}")
        peer = peers.pop()
        if peer not in self._peers:
            raise ValueError(f"agent {self.name!r} does not know peer {peer!r}")
        local, remote = [], []
        for off, region, dst_off, n in descs:
            if off < 0 or off + n > nbytes or dst_off < 0 or dst_off + n > region.nbytes:
                raise ValueError(f"descriptor of {n} B at {off} -> {dst_off} overflows its "
                                 f"source ({nbytes} B) or region ({region.nbytes} B)")
            local.append((addr + off, n, device_id))
            remote.append((region.addr + dst_off, n, region.device_id))
        handle = self._agent.initialize_xfer(
            "WRITE", self._agent.get_xfer_descs(local, mem),
            self._agent.get_xfer_descs(remote, descs[0][1].mem), peer, notif)
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL could not post a write of {len(descs)} ranges to {peer!r}")
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
