"""A cached prefix's KV reaches the decode ranks: each holder streams its copy as one shard of
the prefix pseudo-chunk, the chunks stream the suffix, and the receiver admits the request with
every position's KV bitwise equal to the source (in-process send and receive managers)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tetris.actors.prefill.kv_store import PagedKVStore
from tetris.actors.prefill.prefix import PREFIX_CHUNK, stream_prefix
from tetris.kernels.kv_pack import pack_kv
from tetris.transfer.states import RequestReady, ShardSent

from tetris.config import TransferConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "transfer"))
from transfer_helpers import BS, HKV, LAYERS, Cluster, D, source_kv

CONFIG = TransferConfig(backend="inproc", num_backends=2, pool_size=2, backend_buffer_bytes=4096,
                        send_buffer_bytes=4096, bulk_chunk_bytes=4096, timeout_s=5.0)


def _store_with(kv, ranges) -> PagedKVStore:
    """A worker's store holding ``ranges`` of the source run ``src`` (ground truth ``kv``)."""
    store = PagedKVStore(LAYERS, num_blocks=32, block_size=BS, num_kv_heads=HKV, head_dim=D)
    store.reserve("src", ranges)
    pos = torch.cat([torch.arange(a, b) for a, b in ranges])
    for layer in range(LAYERS):
        store.write("src", layer, ranges, kv[layer][pos, 0], kv[layer][pos, 1])
    return store


def test_prefix_shards_and_chunk_shards_complete_the_request_bitwise():
    total, cached = 50, 36
    kv = source_kv(total, seed=11)        # per layer [n, 2, Hkv, D]; the source's and the run's
    c = Cluster(2, CONFIG)
    # The source's ring left [0, 40) zigzagged over two holders.
    held = {0: ((0, 10), (30, 40)), 1: ((10, 30),)}
    stores = {i: _store_with(kv, r) for i, r in held.items()}
    for i, store in stores.items():
        ranges = store.copy_prefix("src", "run", cached)
        store.free("src")                  # the index let the source go: the copy stays
        stream_prefix(c.senders[i], store, "run", ranges, total, cached, (0,))
    # The run's one chunk [36, 50) on holder 0 streams what it computes.
    c.senders[0].add_shard(request_id="run", chunk_index=0, receiver_id=0, prompt_tokens=total,
                           chunk=(cached, total), ranges=[(cached, total)], num_layers=LAYERS,
                           kv_heads=HKV, head_dim=D, dtype=torch.float32, now=c.now)
    for layer in range(LAYERS):
        c.senders[0].layer_ready("run", 0, layer, kv[layer][cached:total])
    ready = None
    for _ in range(500):
        events = c.step()
        ready = next((e for e in events if isinstance(e, RequestReady)), None)
        if ready is not None:
            break
    assert ready is not None and ready.prompt_tokens == total
    got = pack_kv(c.recv_cache, torch.tensor(ready.block_table, dtype=torch.int32),
                  torch.arange(total), list(range(LAYERS)))
    assert torch.equal(got, torch.stack(kv))
    sent = sorted((s, e.chunk_index) for s, e in c.events if isinstance(e, ShardSent))
    assert sent == [(0, PREFIX_CHUNK), (0, 0), (1, PREFIX_CHUNK)]
    c.close()


def test_heads_split_over_two_decode_ranks():
    kv = source_kv(12, seed=3)
    store = _store_with(kv, ((0, 12),))
    ranges = store.copy_prefix("src", "run", 8)

    class Recorder:
        def __init__(self):
            self.shards, self.layers = {}, {}

        def add_shard(self, **kw):
            self.shards[kw["receiver_id"]] = kw

        def layer_ready(self, rid, chunk, layer, t, receiver_id):
            self.layers[(receiver_id, layer)] = (chunk, t)

    rec = Recorder()
    stream_prefix(rec, store, "run", ranges, 20, 8, (5, 7))
    assert {r: (s["kv_heads"], s["chunk"], s["chunk_index"]) for r, s in rec.shards.items()} == \
        {5: (1, (0, 8), PREFIX_CHUNK), 7: (1, (0, 8), PREFIX_CHUNK)}
    for (r, layer), (chunk, t) in rec.layers.items():
        head = 0 if r == 5 else 1
        assert t.shape == (8, 2, 1, D)
        assert torch.equal(t, kv[layer][:8, :, head:head + 1])


def test_a_prefix_preset_on_the_receiver_is_not_streamed_and_cannot_be_claimed():
    # Prefix caching's decode side: the decode rank copied [0, 36) from a kept run and presets
    # it; only the chunk [36, 50) streams, and the request is ready from it alone. A shard
    # claiming a preset position (a prefix streamed after all) is refused.
    from tetris.transfer.states import MessageRejected

    total, cached = 50, 36
    kv = source_kv(total, seed=5)
    c = Cluster(1, CONFIG)
    assert c.receiver.reserve("run", total, c.now)
    c.receiver.preset("run", cached)
    c.receiver.reserve("dup", total, c.now)
    c.receiver.preset("dup", cached)
    for rid, start in (("run", cached), ("dup", cached - 4)):
        c.senders[0].add_shard(request_id=rid, chunk_index=0, receiver_id=0, prompt_tokens=total,
                               chunk=(start, total), ranges=[(start, total)], num_layers=LAYERS,
                               kv_heads=HKV, head_dim=D, dtype=torch.float32, now=c.now)
        for layer in range(LAYERS):
            c.senders[0].layer_ready(rid, 0, layer, kv[layer][start:total])
    got = []
    for _ in range(500):
        got += c.step()
        if any(isinstance(e, RequestReady) for e in got) and \
                any(isinstance(e, MessageRejected) for e in got):
            break
    assert [e.request_id for e in got if isinstance(e, RequestReady)] == ["run"]
    assert {e.request_id for e in got if isinstance(e, MessageRejected)} == {"dup"}
    c.close()
