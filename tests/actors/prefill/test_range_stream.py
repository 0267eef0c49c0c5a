"""Elastic decode's hand-off from the prefill side (actors/prefill/range_stream.py), in process:
the in-process pool of 2 instances runs a 2-chunk plan (the second chunk SP 2, zigzag shares)
and its members stream each token range of the prompt's KV to the decode receiver that holds
it, in range-local positions, over the in-process transfer backend: tokens [0, 15) to
receiver 1 as ``a@0``, the rest to receiver 0 as ``a``. Each receiver's cache holds exactly its
range of the single model's KV; no first token goes with the KV (the master starts only when
every holder has its range); both senders end holding nothing."""

from __future__ import annotations

import time

import pytest
import torch
from range_ends import End, close, wait_ready, wire
from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.messages import KVRange
from tetris.actors.prefill.threaded import ThreadedPool
from tetris.kernels.attention import attention_with_lse
from tetris.transfer.backends import make_agent
from tetris.transfer.block_allocator import SimpleBlockAllocator
from tetris.transfer.receive_manager import ReceiveManager
from tetris.transfer.send_manager import SendManager
from tetris.transfer.states import FirstTokenIn, RequestReady

from tetris.config import TransferConfig

TRANSFER = TransferConfig(backend="inproc", num_backends=2, pool_size=2, backend_buffer_bytes=8192,
                          send_buffer_bytes=8192, bulk_chunk_bytes=8192, timeout_s=20.0)
N, SPLIT, BS, BLOCKS = 56, 15, 4, 32
RANGES = (KVRange(0, SPLIT, "a@0", (1,)), KVRange(SPLIT, N, "a", (0,)))


@pytest.fixture
def ends(model):
    hkv, d = model.local_num_kv_heads, model.head_dim
    receivers = []
    for r in range(2):
        agent = make_agent(f"range-decode-{r}", backend="inproc")
        cache = [(torch.zeros(BLOCKS, BS, hkv, d), torch.zeros(BLOCKS, BS, hkv, d))
                 for _ in range(model.num_layers)]
        mgr = ReceiveManager(r, cache, SimpleBlockAllocator(BLOCKS), agent, TRANSFER)
        receivers.append((End(f"range-recv-{r}", mgr, agent), cache))
    senders = []
    for s in range(2):
        agent = make_agent(f"range-prefill-{s}", backend="inproc")
        senders.append(End(f"range-send-{s}", SendManager(s, agent, TRANSFER), agent))
    wire(senders, [recv for recv, _ in receivers])
    yield senders, receivers
    close(senders + [r for r, _ in receivers])


def _reference_kv(model, prompt):
    kv = []

    def attention(i, q, k, v):
        kv.append((k, v))
        return attention_with_lse(q, k, v, causal=True)[0]

    with torch.inference_mode():
        model(torch.tensor(prompt), torch.arange(len(prompt)), attention)
    return kv


def test_each_range_streams_to_its_holder_in_range_local_positions(model, ends):
    senders, receivers = ends
    pool = ThreadedPool(model, 2, num_blocks=64, block_size=16, timeout_s=20.0)
    for ex, s in zip(pool.executors, senders, strict=True):
        ex.pump = s.pump
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.cfg.vocab_size, (N,), generator=gen).tolist()
    for rng in RANGES:
        recv, _ = receivers[rng.receivers[0]]
        with recv.pump.locked() as mgr:
            assert mgr.reserve(rng.transfer_id, rng.end - rng.start, time.monotonic())
    plan = forced_plan("a", N, "20x1,restx2", (0, 0))
    assert [len(c.instances) for c in plan.chunks] == [1, 2]
    result = pool.run(plan, prompt, kv_ranges=RANGES)
    outcomes = wait_ready([recv for recv, _ in receivers], RANGES, 20.0)
    assert all(isinstance(e, RequestReady) for e in outcomes.values()) and len(outcomes) == 2
    ref = _reference_kv(model, prompt)
    for rng in RANGES:
        _, cache = receivers[rng.receivers[0]]
        n = rng.end - rng.start      # one reservation per receiver: blocks 0, 1, ... in order
        for layer, (k, v) in enumerate(ref):
            got_k = cache[layer][0].reshape(-1, *k.shape[1:])[:n]
            got_v = cache[layer][1].reshape(-1, *v.shape[1:])[:n]
            torch.testing.assert_close(got_k, k[rng.start:rng.end], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_v, v[rng.start:rng.end], rtol=1e-5, atol=1e-5)
    assert not any(isinstance(e, FirstTokenIn) for r, _ in receivers for e in r.events)
    assert result.first_token is not None
    pool.release("a")
    for s in senders:
        with s.pump.locked() as mgr:
            assert not mgr.shards
