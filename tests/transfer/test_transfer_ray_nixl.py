"""Integrity through NIXL (UCX) between separate Ray actors: three prefill senders with uneven,
non-contiguous shards over two chunks stream layer by layer to one decode receiver."""

from __future__ import annotations

import time

import pytest
import torch

from tetris.config import TransferConfig
from tetris.transfer.backends import nixl_unavailable_reason
from tetris.transfer.endpoints import ReceiverEndpoint, SenderEndpoint
from tetris.transfer.states import MessageRejected, RequestReady, TransferFailed

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

LAYERS, HKV, D, BS, BLOCKS = 3, 2, 16, 8, 20
PROMPT = 93
CHUNKS = {0: (0, 40), 1: (40, 93)}
# (sender, chunk, ranges): chunk 0 split unevenly over senders 0, 1 (zigzag-like two pieces on
# sender 0); chunk 1 over senders 0, 1, 2 with uneven sizes.
SHARDS = [
    (0, 0, [(0, 10), (30, 40)]),
    (1, 0, [(10, 30)]),
    (0, 1, [(40, 49), (84, 93)]),
    (1, 1, [(49, 58), (75, 84)]),
    (2, 1, [(58, 75)]),
]
FREE_ORDER = [7, 3, 19, 0, 12, 5, 16, 1, 9, 14, 2, 18, 6, 11, 4, 15, 8, 13, 10, 17]


def ground_truth() -> torch.Tensor:
    g = torch.Generator().manual_seed(100)
    return torch.randn((LAYERS, PROMPT, 2, HKV, D), generator=g)


class _Router:
    def __init__(self, ray, receiver, senders) -> None:
        self.ray, self.receiver, self.senders = ray, receiver, senders
        self.inbox: dict = {"r": [], **{i: [] for i in range(len(senders))}}
        self.ready: RequestReady | None = None

    def round(self) -> None:
        ray = self.ray
        outs = ray.get([s.step.remote(self.inbox[i]) for i, s in enumerate(self.senders)])
        for i in range(len(self.senders)):
            self.inbox[i] = []
        for events, envs in outs:
            assert not [e for e in events if isinstance(e, TransferFailed)], events
            self.inbox["r"].extend(env.msg for env in envs)
        events, envs = ray.get(self.receiver.step.remote(self.inbox["r"]))
        self.inbox["r"] = []
        for env in envs:
            self.inbox[env.dst_id].append(env.msg)
        for e in events:
            assert not isinstance(e, MessageRejected), e
            if isinstance(e, RequestReady):
                self.ready = e


def test_kv_bitwise_equal_through_nixl_between_ray_actors(ray_session):
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    ray = ray_session
    # 2 backends for 3 senders: the ordered (scarce) path; 4 KiB pieces (16 tokens): shards of 17-20
    # tokens take two pieces per layer
    config = TransferConfig(num_backends=2, pool_size=3, backend_buffer_bytes=4096,
                            send_buffer_bytes=4096, bulk_chunk_bytes=4096)
    receiver = ray.remote(num_cpus=0)(ReceiverEndpoint).remote(
        0, config, num_layers=LAYERS, num_blocks=BLOCKS, block_size=BS, kv_heads=HKV, head_dim=D,
        free_blocks=FREE_ORDER)
    senders = [ray.remote(num_cpus=0)(SenderEndpoint).remote(i, config) for i in range(3)]
    info = ray.get(receiver.info.remote())
    assert info.backend == "nixl-ucx"
    ray.get([s.add_peer.remote(info) for s in senders])
    truth = ground_truth()
    router = _Router(ray, receiver, senders)

    for chunk in (0, 1):
        shards = [(s, r) for s, c, r in SHARDS if c == chunk]
        ray.get([senders[s].add_shard.remote(
            request_id="req", chunk_index=chunk, receiver_id=0, prompt_tokens=PROMPT, chunk=CHUNKS[chunk],
            ranges=r, num_layers=LAYERS, kv_heads=HKV, head_dim=D, dtype=torch.float32) for s, r in shards])
        # layers become ready one at a time with transfer rounds in between (layer-wise streaming)
        for layer in range(LAYERS):
            ray.get([senders[s].layer_ready.remote(
                "req", chunk, layer, truth[layer][torch.cat([torch.arange(a, b) for a, b in r])])
                for s, r in shards])
            router.round()
    deadline = time.monotonic() + 60
    while router.ready is None and time.monotonic() < deadline:
        router.round()
    assert router.ready is not None, "the request never completed"
    assert router.ready.block_table == FREE_ORDER[:12]   # ceil(93 / 8) blocks, scattered
    got = ray.get(receiver.read_back.remote(router.ready.block_table, PROMPT))
    assert torch.equal(got, truth)
    for actor in [receiver, *senders]:
        ray.kill(actor)
