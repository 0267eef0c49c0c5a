"""KV buffers register where they live: VRAM on a GPU, DRAM on the host (transfer/backends/nixl_ucx.py).

Runs without a GPU: the memory type and descriptors are checked on the inputs that decide them
(a tensor's device), the NIXL calls on a recording stand-in for nixl's agent, and the staging
buffer's move on the "meta" device (a device other than the CPU that holds no bytes).
"""

from __future__ import annotations

import pytest
import torch

from tetris.config import TransferConfig
from tetris.transfer.backends.base import BackendCapabilities, TransferAgent
from tetris.transfer.backends.nixl_ucx import NixlAgent, nixl_segment
from tetris.transfer.block_allocator import SimpleBlockAllocator
from tetris.transfer.messages import AgentInfo, Grant, RegionDesc
from tetris.transfer.receive_manager import ReceiveManager
from tetris.transfer.send_manager import SendManager


def test_the_memory_type_and_device_id_follow_the_tensor_s_device():
    assert nixl_segment(4096, 64, torch.device("cpu")) == ("DRAM", 0)
    assert nixl_segment(4096, 64, torch.device("cuda", 3)) == ("VRAM", 3)
    assert nixl_segment(4096, 64, torch.device("cuda")) == ("VRAM", 0)
    with pytest.raises(ValueError):
        nixl_segment(4096, 64, torch.device("meta"))


class _RecordingNixl:
    """What NixlAgent asks of nixl's agent, recorded."""

    def __init__(self):
        self.calls = []

    def register_memory(self, descs, mem):
        self.calls.append(("register", descs, mem))
        return object()

    def get_xfer_descs(self, descs, mem):
        self.calls.append(("xfer", descs, mem))
        return (descs, mem)

    def initialize_xfer(self, op, local, remote, agent, notif):
        return (op, local, remote, agent, notif)

    def transfer(self, handle):
        return "PROC"


def _nixl_agent() -> NixlAgent:
    agent = NixlAgent.__new__(NixlAgent)   # no nixl process: the stand-in takes its calls
    agent.name, agent._agent = "a", _RecordingNixl()
    agent._registered, agent._peers = {}, {"decode-0": b"md"}
    return agent


def test_a_host_buffer_registers_as_dram_and_writes_into_a_peer_s_vram_region():
    agent = _nixl_agent()
    buf = torch.zeros(256, dtype=torch.uint8)
    region = agent.register(buf)
    assert region == RegionDesc(agent="a", addr=buf.data_ptr(), nbytes=256, device_id=0, mem="DRAM")
    assert agent._agent.calls == [("register", [(buf.data_ptr(), 256, 0, "")], "DRAM")]
    agent.register(buf)   # once per buffer
    assert len(agent._agent.calls) == 1
    peer = RegionDesc(agent="decode-0", addr=1 << 40, nbytes=1024, device_id=2, mem="VRAM")
    handle = agent.write(buf[:100], peer, 512, b"n")
    assert handle[1] == ([(buf.data_ptr(), 100, 0)], "DRAM")
    assert handle[2] == ([((1 << 40) + 512, 100, 2)], "VRAM")
    with pytest.raises(ValueError):
        agent.write(buf[:100], peer, 1000, b"n")   # past the region's end


class _DeviceAgent(TransferAgent):
    """Records which device each registered buffer and each written source is on."""

    name, backend = "send", "recording"
    capabilities = BackendCapabilities(cross_process=False, device_memory=True)

    def __init__(self):
        self.registered, self.deregistered, self.writes = [], [], []

    def info(self):
        return AgentInfo(name=self.name, backend=self.backend, metadata=b"")

    def add_peer(self, info):
        pass

    def remove_peer(self, name):
        pass

    def register(self, buffer):
        self.registered.append(buffer.device.type)
        return RegionDesc(agent=self.name, addr=0, nbytes=buffer.numel())

    def deregister(self, buffer):
        self.deregistered.append(buffer.device.type)

    def write(self, src, dst, dst_offset, notif):
        self.writes.append(src.device.type)
        return len(self.writes)

    def status(self, handle):
        return "done"

    def release(self, handle):
        pass

    def notifications(self):
        return []


def test_the_sender_stages_on_the_device_its_kv_was_computed_on():
    agent, cfg = _DeviceAgent(), TransferConfig()
    mgr = SendManager(0, agent, cfg)
    assert agent.registered == ["cpu"]
    mgr.add_shard(request_id="r", chunk_index=0, receiver_id=0, prompt_tokens=4, chunk=(0, 4),
                  ranges=[(0, 4)], num_layers=1, kv_heads=2, head_dim=8, dtype=torch.float32,
                  now=0.0)
    region = RegionDesc(agent="recv", addr=0, nbytes=1 << 20, mem="VRAM")
    mgr.deliver(Grant(request_id="r", sender_id=0, chunk_index=0, backend_id=0, region=region,
                      max_piece_bytes=1 << 20, receiver_id=0), 0.0)
    mgr.layer_ready("r", 0, 0, torch.empty(4, 2, 2, 8, device="meta"))
    mgr.poll(0.0)
    assert agent.writes == ["meta"]              # written from a buffer beside the KV
    assert agent.registered == ["cpu", "meta"] and agent.deregistered == ["cpu"]
    mgr.close()
    assert agent.deregistered == ["cpu", "meta"]


def test_the_receiver_s_buffers_live_beside_its_kv_cache():
    agent = _DeviceAgent()
    cache = [(torch.empty(4, 4, 2, 8, device="meta"), torch.empty(4, 4, 2, 8, device="meta"))]
    ReceiveManager(0, cache, SimpleBlockAllocator(4), agent, TransferConfig(num_backends=2))
    assert agent.registered == ["meta", "meta"]
