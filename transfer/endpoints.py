"""Plain classes that host a manager inside a Ray actor: the reference way to drive them.

    Sender = ray.remote(num_cpus=0)(SenderEndpoint)
    s = Sender.remote(sender_id, config)          # NIXL agent "prefill-<id>" by default
    r = ray.remote(num_cpus=0)(ReceiverEndpoint).remote(0, config, num_layers, ...)
    ray.get(s.add_peer.remote(ray.get(r.info.remote())))   # agent metadata through Ray
    events, envelopes = ray.get(s.step.remote(inbox))      # deliver, poll, drain: one call

The owner routes each ``Envelope`` to the manager named by ``dst_role``/``dst_id`` with the next
``step`` of that endpoint. The prefill worker and decode instance actors embed the managers the
same way (their own loop calls ``deliver``/``poll``/``drain_outbox``), so these classes double
as the integration fixture for tests and the transfer benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from tetris.config import TransferConfig
from tetris.kernels.kv_pack_dispatch import pack_kv
from tetris.transfer.backends import make_agent
from tetris.transfer.block_allocator import SimpleBlockAllocator
from tetris.transfer.messages import AgentInfo, ControlMessage, Envelope
from tetris.transfer.receive_manager import ReceiveManager
from tetris.transfer.send_manager import SendManager
from tetris.transfer.states import TransferEvent

__all__ = ["SenderEndpoint", "ReceiverEndpoint"]


class SenderEndpoint:
    def __init__(self, sender_id: int, config: TransferConfig, backend: str = "nixl") -> None:
        self.agent = make_agent(f"prefill-{sender_id}", backend=backend)
        self.mgr = SendManager(sender_id, self.agent, config)

    def info(self) -> AgentInfo:
        return self.agent.info()

    def add_peer(self, info: AgentInfo) -> None:
        self.agent.add_peer(info)

    def add_shard(self, **kwargs) -> None:
        self.mgr.add_shard(now=time.monotonic(), **kwargs)

    def layer_ready(self, request_id: str, chunk_index: int, layer: int, kv: torch.Tensor) -> None:
        self.mgr.layer_ready(request_id, chunk_index, layer, kv)

    def step(self, inbox: Sequence[ControlMessage]) -> tuple[list[TransferEvent], list[Envelope]]:
        now = time.monotonic()
        for msg in inbox:
            self.mgr.deliver(msg, now)
        events = self.mgr.poll(now)
        return events, self.mgr.drain_outbox()


class ReceiverEndpoint:
    """A receive manager over its own paged cache ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, receiver_id: int, config: TransferConfig, *, num_layers: int, num_blocks: int,
                 block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 backend: str = "nixl", free_blocks: Sequence[int] | None = None) -> None:
        self.agent = make_agent(f"decode-{receiver_id}", backend=backend)
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.cache = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(num_layers)]
        self.allocator = SimpleBlockAllocator(num_blocks, free_blocks)
        self.mgr = ReceiveManager(receiver_id, self.cache, self.allocator, self.agent, config)

    def info(self) -> AgentInfo:
        return self.agent.info()

    def step(self, inbox: Sequence[ControlMessage]) -> tuple[list[TransferEvent], list[Envelope]]:
        now = time.monotonic()
        for msg in inbox:
            self.mgr.deliver(msg, now)
        events = self.mgr.poll(now)
        return events, self.mgr.drain_outbox()

    def read_back(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """``[num_layers, num_tokens, 2, Hkv, D]`` of positions ``[0, num_tokens)`` from the cache."""
        table = torch.tensor(block_table, dtype=torch.int32)
        return pack_kv(self.cache, table, torch.arange(num_tokens), list(range(len(self.cache))))
