"""Backend starvation (paper §4.2): 8 senders, 2 receive backends, 20 concurrent two-chunk
requests. First-handshake ordering completes every request, in order, with at most two
half-filled requests at a time; naive per-chunk first-come allocation lets early requests
sit half-filled behind everyone's first chunk, later the more requests there are."""

from __future__ import annotations

import torch
from transfer_helpers import HKV, LAYERS, D, Cluster, source_kv

from tetris.config import TransferConfig
from tetris.transfer.messages import Grant
from tetris.transfer.states import ChunkArrived, RequestReady

SENDERS, BACKENDS = 8, 2
PROMPT, SPLIT = 16, 8     # chunk 0 = [0, 8) on 2 senders, chunk 1 = [8, 16) on 4 senders


def _config(policy: str) -> TransferConfig:
    return TransferConfig(num_backends=BACKENDS, pool_size=SENDERS, backend_buffer_bytes=2048,
                          send_buffer_bytes=2048, bulk_chunk_bytes=2048, policy=policy, timeout_s=1e9)


def _shards(r: int):
    """Chunk 0 zigzag over 2 senders, chunk 1 over 4, rotating over the 8 senders."""
    c0 = [((2 * r) % SENDERS, [(0, 2), (6, 8)]), ((2 * r + 1) % SENDERS, [(2, 6)])]
    c1 = [((r + k) % SENDERS, [(8 + 2 * k, 10 + 2 * k)]) for k in range(4)]
    return c0, c1


def _add(c, sender, rid, chunk, span, ranges, kv):
    mgr = c.senders[sender]
    mgr.add_shard(request_id=rid, chunk_index=chunk, receiver_id=0, prompt_tokens=PROMPT, chunk=span,
                  ranges=ranges, num_layers=LAYERS, kv_heads=HKV, head_dim=D, dtype=torch.float32, now=c.now)
    pos = torch.cat([torch.arange(a, b) for a, b in ranges])
    for layer in range(LAYERS):
        mgr.layer_ready(rid, chunk, layer, kv[layer][pos])


def _run(policy: str, num_requests: int):
    """All first chunks handshake at once (in request order); every second chunk one step
    later, as when the next chunk's prefill starts on a larger group. Runs to completion."""
    c = Cluster(SENDERS, _config(policy), kv_blocks=4 * num_requests)
    kv = source_kv(PROMPT, seed=11)
    plans = [_shards(r) for r in range(num_requests)]
    for r, (c0, _) in enumerate(plans):
        for sender, ranges in c0:
            _add(c, sender, f"r{r:02d}", 0, (0, SPLIT), ranges, kv)
        c.route()   # so the receiver sees first handshakes in request order
    c.step()
    for r, (_, c1) in enumerate(plans):
        for sender, ranges in c1:
            _add(c, sender, f"r{r:02d}", 1, (SPLIT, PROMPT), ranges, kv)
    first_grant, done, partial, peak_partial = [], [], set(), 0
    half_filled = {}   # request -> steps between its first chunk arriving and completion
    for step in range(50 * num_requests):
        c.route()
        for i in sorted(c.senders):
            c.senders[i].poll(c.now)
        c.route()
        events = c.receiver.poll(c.now)
        grants = [env.msg for env in c.receiver.drain_outbox() if isinstance(env.msg, Grant)]
        for g in grants:
            if g.request_id not in first_grant:
                first_grant.append(g.request_id)
            c.senders[g.sender_id].deliver(g, c.now)
        for e in events:
            if isinstance(e, ChunkArrived) and e.chunk_index == 0:
                partial.add(e.request_id)
                half_filled[e.request_id] = -step
            if isinstance(e, RequestReady):
                partial.discard(e.request_id)
                half_filled[e.request_id] += step
                done.append(e.request_id)
        peak_partial = max(peak_partial, len(partial))
        c.now += 0.01
        if len(done) == num_requests:
            break
    return c, first_grant, done, peak_partial, half_filled


def test_first_handshake_order_completes_all_requests_in_order():
    c, first_grant, done, peak_partial, _ = _run("handshake_order", 20)
    order = [f"r{r:02d}" for r in range(20)]
    assert done == order, "every request completes, in first-handshake order"
    assert first_grant == order
    assert peak_partial <= BACKENDS          # at most one half-filled request per backend
    assert not c.receiver.requests and c.allocator.num_free == c.allocator.num_blocks - 20 * 4


def test_naive_per_chunk_allocation_starves_early_requests():
    waits = {}
    for n in (20, 40):
        _, _, done, peak_partial, half_filled = _run("per_chunk_fcfs", n)
        assert len(done) == n
        # every first chunk is served before any second chunk: all requests sit half-filled at
        # once, each holding decode blocks, r00 included
        assert peak_partial == n
        waits[n] = half_filled["r00"]
        _, _, ordered_done, ordered_peak, ordered_half = _run("handshake_order", n)
        assert ordered_done.index("r00") == 0 and ordered_peak <= BACKENDS
        assert ordered_half["r00"] < waits[n] / 5
    # the time r00 sits half-filled grows with the number of competing requests: unbounded
    assert waits[40] > 1.8 * waits[20]
