"""In-process wiring of send and receive managers for tests: routes envelopes, steps a clock."""

from __future__ import annotations

import itertools

import torch

from tetris.config import TransferConfig
from tetris.kernels.kv_pack import pack_kv
from tetris.transfer.backends import InProcAgent
from tetris.transfer.block_allocator import SimpleBlockAllocator
from tetris.transfer.receive_manager import ReceiveManager
from tetris.transfer.send_manager import SendManager

_names = itertools.count()

LAYERS, HKV, D, BS = 2, 2, 8, 4


def paged_cache(num_layers: int, num_blocks: int, *, fill: bool, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(num_layers):
        shape = (num_blocks, BS, HKV, D)
        if fill:
            caches.append((torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)))
        else:
            caches.append((torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))
    return caches


class Cluster:
    """``num_senders`` send managers and one receive manager on in-process agents."""

    def __init__(self, num_senders: int, config: TransferConfig, *, kv_blocks: int = 64) -> None:
        tag = next(_names)
        self.config = config
        self.recv_agent = InProcAgent(f"recv{tag}")
        self.allocator = SimpleBlockAllocator(kv_blocks)
        self.recv_cache = paged_cache(LAYERS, kv_blocks, fill=False)
        self.receiver = ReceiveManager(0, self.recv_cache, self.allocator, self.recv_agent, config)
        self.senders = {}
        for i in range(num_senders):
            agent = InProcAgent(f"send{tag}-{i}")
            agent.add_peer(self.recv_agent.info())
            self.senders[i] = SendManager(i, agent, config)
        self.events: list = []
        self.now = 0.0

    def route(self) -> None:
        for mgr in list(self.senders.values()):
            for env in mgr.drain_outbox():
                self.receiver.deliver(env.msg, self.now)
        for env in self.receiver.drain_outbox():
            self.senders[env.dst_id].deliver(env.msg, self.now)

    def step(self, dt: float = 0.01) -> list:
        """One round: route, poll everyone, route again. Returns the receiver's events."""
        self.now += dt
        self.route()
        for i in sorted(self.senders):
            self.events.extend((i, e) for e in self.senders[i].poll(self.now))
        self.route()
        got = self.receiver.poll(self.now)
        self.route()
        return got

    def close(self) -> None:
        self.receiver.close()
        self.recv_agent.close()
        for mgr in self.senders.values():
            mgr.close()
            mgr.agent.close()


def source_kv(num_tokens: int, seed: int) -> list[torch.Tensor]:
    """Per layer the ground-truth KV of a request's positions [0, num_tokens): [n, 2, Hkv, D]."""
    blocks = -(-num_tokens // BS)
    cache = paged_cache(LAYERS, blocks, fill=True, seed=seed)
    table = torch.arange(blocks, dtype=torch.int32)
    packed = pack_kv(cache, table, torch.arange(num_tokens), list(range(LAYERS)))
    return [packed[layer] for layer in range(LAYERS)]
