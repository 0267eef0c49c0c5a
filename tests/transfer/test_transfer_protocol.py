"""Send/receive managers over the in-process backend: integrity, layer-wise streaming, bad
messages, aborts, timeouts and lost peers (deterministic clock)."""

from __future__ import annotations

import pytest
import torch
from transfer_helpers import HKV, LAYERS, D, Cluster, source_kv

from tetris.config import TransferConfig
from tetris.kernels.kv_pack import pack_kv
from tetris.transfer.messages import (Abort, Grant, Handshake, PieceNotice, TokenRange, TransferError,
                                      encode_notice)
from tetris.transfer.states import (ChunkArrived, MessageRejected, RequestReady, ShardSent, TransferFailed,
                                    TransferState)

SMALL = TransferConfig(num_backends=2, pool_size=3, backend_buffer_bytes=1024, send_buffer_bytes=1024,
                       bulk_chunk_bytes=512, timeout_s=1.0, abort_grace_s=0.05)


def _add(cluster, sender, rid, chunk, span, ranges, prompt, *, kv=None, layers=()):
    cluster.senders[sender].add_shard(request_id=rid, chunk_index=chunk, receiver_id=0, prompt_tokens=prompt,
                                      chunk=span, ranges=ranges, num_layers=LAYERS, kv_heads=HKV, head_dim=D,
                                      dtype=torch.float32, now=cluster.now)
    pos = torch.cat([torch.arange(a, b) for a, b in ranges])
    for layer in layers:
        cluster.senders[sender].layer_ready(rid, chunk, layer, kv[layer][pos])
    return pos


def _run_until(cluster, cond, limit=500):
    for _ in range(limit):
        events = cluster.step()
        if cond(events):
            return events
    raise AssertionError("condition not reached")


def _cache_snapshot(cluster):
    return [(k.clone(), v.clone()) for k, v in cluster.recv_cache]


def _same_cache(a, b):
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_uneven_shards_over_two_chunks_arrive_bitwise_equal_layer_by_layer():
    c = Cluster(3, SMALL)
    L = 45
    kv = source_kv(L, seed=3)
    shards = [(0, 0, (0, 20), [(0, 4), (16, 20)]), (1, 0, (0, 20), [(4, 16)]),
              (0, 1, (20, 45), [(20, 23), (41, 45)]), (1, 1, (20, 45), [(23, 30)]), (2, 1, (20, 45), [(30, 41)])]
    positions = {}
    for s, chunk, span, ranges in shards:
        if chunk == 0:
            positions[(s, chunk)] = _add(c, s, "r", chunk, span, ranges, L, kv=kv, layers=[0])
    # only layer 0 of chunk 0 is computed: it streams while layer 1 "computes"
    _run_until(c, lambda ev: c.receiver.requests["r"].coverage[0, :20].all())
    assert not c.receiver.requests["r"].coverage[1].any()
    assert c.receiver.state("r") == TransferState.TRANSFERRING
    for s, chunk, span, ranges in shards:
        if chunk == 0:
            c.senders[s].layer_ready("r", 0, 1, kv[1][positions[(s, 0)]])
    events = _run_until(c, lambda ev: any(isinstance(e, ChunkArrived) for e in ev))
    assert [e.chunk_index for e in events if isinstance(e, ChunkArrived)] == [0]
    for s, chunk, span, ranges in shards:
        if chunk == 1:
            _add(c, s, "r", chunk, span, ranges, L, kv=kv, layers=range(LAYERS))
    events = _run_until(c, lambda ev: any(isinstance(e, RequestReady) for e in ev))
    ready = next(e for e in events if isinstance(e, RequestReady))
    got = pack_kv(c.recv_cache, torch.tensor(ready.block_table, dtype=torch.int32), torch.arange(L),
                  list(range(LAYERS)))
    assert torch.equal(got, torch.stack(kv))
    sent = sorted((s, e.chunk_index) for s, e in c.events if isinstance(e, ShardSent))
    assert sent == sorted((s, chunk) for s, chunk, *_ in shards)
    assert c.receiver.state("r") == TransferState.DONE
    assert c.allocator.num_free == 64 - len(ready.block_table)   # the blocks now belong to the engine


def test_dedicated_backends_serve_each_sender_without_ordering():
    cfg = TransferConfig(num_backends=3, pool_size=3, backend_buffer_bytes=1024, send_buffer_bytes=1024,
                         bulk_chunk_bytes=1024)
    c = Cluster(3, cfg)
    kv = source_kv(30, seed=4)
    for s in range(3):
        _add(c, s, "r", 0, (0, 30), [(10 * s, 10 * s + 10)], 30, kv=kv, layers=range(LAYERS))
    c.step()
    holders = {b.backend_id: set(b.credits.values()) for b in c.receiver.backends}
    assert holders == {0: {("r", (0, 0))}, 1: {("r", (1, 0))}, 2: {("r", (2, 0))}}
    _run_until(c, lambda ev: any(isinstance(e, RequestReady) for e in ev))


def test_dedicated_backends_refuse_a_sender_outside_the_pool_at_its_handshake():
    """Backend i serves prefill instance i: a sender id past the pool would wait for a grant
    that never comes, so its handshake is refused at once, with the reason."""
    cfg = TransferConfig(num_backends=2, pool_size=2, backend_buffer_bytes=1024, send_buffer_bytes=1024,
                         bulk_chunk_bytes=1024)
    c = Cluster(2, cfg)
    _add(c, 0, "r", 0, (0, 8), [(0, 8)], 8)
    hs = c.senders[0].shards[("r", 0, 0)].handshake
    c.receiver.deliver(_handshake_like(hs, sender_id=5), c.now)
    reasons = [e.reason for e in c.receiver.poll(c.now) if isinstance(e, MessageRejected)]
    assert len(reasons) == 1 and "sender 5 is outside the prefill pool of 2" in reasons[0]
    errors = [env for env in c.receiver.drain_outbox() if isinstance(env.msg, TransferError)]
    assert [env.dst_id for env in errors] == [5]


def _one_shard(c, rid="r", L=16):
    kv = source_kv(L, seed=5)
    _add(c, 0, rid, 0, (0, L), [(0, L)], L, kv=kv, layers=range(LAYERS))
    return kv


def _grant_for(c, rid):
    for mgr in c.senders.values():   # sender -> receiver only: grants stay with the test
        for env in mgr.drain_outbox():
            c.receiver.deliver(env.msg, c.now)
    c.receiver.poll(c.now)
    return next(env.msg for env in c.receiver.drain_outbox() if isinstance(env.msg, Grant) and env.msg.request_id == rid)


def _forge(c, grant, **changes):
    """Write bytes straight into the granted buffer with a hand-made notice (a buggy sender)."""
    fields = dict(request_id=grant.request_id, sender_id=0, chunk_index=grant.chunk_index,
                  backend_id=grant.backend_id, layer=0, token_offset=0, num_tokens=2, nbytes=2 * 2 * HKV * D * 4,
                  dtype="float32")
    fields.update(changes)
    notice = PieceNotice(**fields)
    agent = c.senders[0].agent
    src = torch.full((notice.nbytes // 4,), 7.0)
    agent.register(src)
    assert agent.status(agent.write(src, grant.region, 0, encode_notice(notice))) == "done"
    events = c.receiver.poll(c.now)
    agent.deregister(src)
    return events


@pytest.mark.parametrize("changes, reason, fails", [
    (dict(request_id="ghost"), "unknown request", False),
    (dict(nbytes=2 * 2 * HKV * D * 4 - 4), "bytes for 2 tokens", True),
    (dict(dtype="bfloat16"), "dtype bfloat16", True),
    (dict(layer=LAYERS), "outside the shard", True),
    (dict(chunk_index=3), "no handshake for chunk 3", False),
])
def test_bad_pieces_are_rejected_and_write_nothing(changes, reason, fails):
    c = Cluster(1, SMALL)
    _one_shard(c)
    grant = _grant_for(c, "r")   # kept from the real sender: the test writes in its place
    before = _cache_snapshot(c)
    free_before = c.allocator.num_free
    events = _forge(c, grant, **changes)
    rejected = [e for e in events if isinstance(e, MessageRejected)]
    assert len(rejected) == 1 and reason in rejected[0].reason
    assert _same_cache(before, c.recv_cache)
    out = [env.msg for env in c.receiver.drain_outbox()]
    assert any(isinstance(m, TransferError) and reason in m.reason for m in out)
    if fails:
        # the sender fails that shard on the error, so "r" can never complete: it fails now,
        # not at the stall timeout, and its blocks are free at once
        failed = [e for e in events if isinstance(e, TransferFailed)]
        assert len(failed) == 1 and failed[0].request_id == "r" and reason in failed[0].reason
        assert "r" not in c.receiver.requests and c.receiver.state("r") == TransferState.FAILED
        assert c.allocator.num_free > free_before
    else:
        # the message named no shard of "r" that a sender will now give up: "r" goes on
        assert not any(isinstance(e, TransferFailed) for e in events)
        assert not c.receiver.requests["r"].coverage.any()
        assert c.receiver.state("r") != TransferState.FAILED


def _handshake_like(hs, **changes):
    return Handshake(**{**{f: getattr(hs, f) for f in hs.__struct_fields__}, **changes})


@pytest.mark.parametrize("changes, reason", [
    (dict(), "duplicate shard"),                                                 # the same chunk twice
    (dict(sender_id=1, ranges=(TokenRange(8, 12),)), "duplicate shard"),         # overlaps sender 0's
    (dict(chunk_index=1, head_dim=D * 2), "KV shape"),
])
def test_bad_handshake_of_a_live_request_fails_it_at_once(changes, reason):
    c = Cluster(2, SMALL)
    _one_shard(c)
    _grant_for(c, "r")
    free_before = c.allocator.num_free
    hs = c.senders[0].shards[("r", 0, 0)].handshake
    c.receiver.deliver(_handshake_like(hs, **changes), c.now)
    events = c.receiver.poll(c.now)
    assert [e.reason for e in events if isinstance(e, MessageRejected)] == [
        e.reason for e in events if isinstance(e, MessageRejected) and reason in e.reason]
    assert sum(isinstance(e, MessageRejected) for e in events) == 1
    # the refused shard's tokens will never come: "r" fails now and frees its blocks, and its
    # registered sender is told to stop
    assert [e.request_id for e in events if isinstance(e, TransferFailed)] == ["r"]
    assert c.receiver.state("r") == TransferState.FAILED
    assert c.allocator.num_free > free_before
    out = c.receiver.drain_outbox()
    assert any(isinstance(env.msg, Abort) and env.dst_id == 0 for env in out)
    for env in out:
        c.senders[env.dst_id].deliver(env.msg, c.now)
    assert c.senders[0].state("r", 0) == TransferState.FAILED


def test_duplicate_piece_is_rejected_and_changes_nothing():
    c = Cluster(1, SMALL)
    _one_shard(c)
    grant = _grant_for(c, "r")
    assert _forge(c, grant) == []                 # first copy of the piece is placed
    placed = _cache_snapshot(c)
    assert c.receiver.requests["r"].coverage[0, :2].all()
    grant = _grant_for(c, "r")
    events = _forge(c, grant)                     # the same piece again
    assert any("duplicate piece" in e.reason for e in events if isinstance(e, MessageRejected))
    assert _same_cache(placed, c.recv_cache)
    assert any(isinstance(e, TransferFailed) and "duplicate piece" in e.reason for e in events)


def test_receiver_forgets_the_oldest_finished_requests_past_its_memory():
    cfg = TransferConfig(**{**{f: getattr(SMALL, f) for f in SMALL.__struct_fields__}, "closed_memory": 2})
    c = Cluster(1, cfg)
    for rid in ("a", "b", "c"):
        c.receiver.reserve(rid, 8, c.now)
        c.receiver.abort(rid, "client gone", c.now)
    assert c.receiver.state("a") is None          # forgotten: the oldest of three
    assert c.receiver.state("b") == c.receiver.state("c") == TransferState.FAILED
    with pytest.raises(ValueError, match="closed_memory"):
        TransferConfig(closed_memory=0)


def test_sender_abort_mid_transfer_frees_blocks_and_backends():
    c = Cluster(2, SMALL)
    kv = source_kv(40, seed=6)
    _add(c, 0, "a", 0, (0, 40), [(0, 20)], 40, kv=kv, layers=range(LAYERS))
    _add(c, 1, "a", 0, (0, 40), [(20, 40)], 40, kv=kv, layers=range(LAYERS))
    free_before = c.allocator.num_free
    _run_until(c, lambda ev: c.receiver.requests["a"].coverage.sum() > 8)
    assert c.allocator.num_free == free_before - 10
    c.senders[0].abort("a", "client cancelled")
    events = c.step()
    assert any(isinstance(e, TransferFailed) and "client cancelled" in e.reason for e in events)
    assert c.allocator.num_free == free_before + 0 and "a" not in c.receiver.requests
    assert c.receiver.state("a") == TransferState.FAILED
    # the other sender is told, and its shard fails too
    c.step()
    assert c.senders[1].state("a", 0) == TransferState.FAILED
    assert all(b.holder is None and not b.credits for b in c.receiver.backends)
    # a late handshake of the aborted request is refused, not allocated
    _add(c, 0, "a", 1, (0, 40), [(0, 5)], 40, kv=kv)
    events = c.step()
    assert any(isinstance(e, MessageRejected) and "already" in e.reason for e in events)
    assert c.allocator.num_free == free_before
    # after the grace period the backends serve a new request to completion
    c.now += SMALL.abort_grace_s
    _add(c, 1, "b", 0, (0, 8), [(0, 8)], 8, kv=source_kv(8, seed=7), layers=range(LAYERS))
    _run_until(c, lambda ev: any(isinstance(e, RequestReady) and e.request_id == "b" for e in ev))


def test_receiver_timeout_and_lost_sender_free_everything():
    c = Cluster(2, SMALL)
    kv = source_kv(16, seed=8)
    _add(c, 0, "slow", 0, (0, 16), [(0, 16)], 16, kv=kv)          # handshakes, never computes a layer
    _add(c, 1, "lost", 0, (0, 16), [(0, 16)], 16, kv=kv, layers=[0])
    for _ in range(3):
        c.step()
    assert c.allocator.num_free == 64 - 8
    c.receiver.peer_lost(1, c.now)
    events = c.step()
    assert [e.request_id for e in events if isinstance(e, TransferFailed)] == ["lost"]
    assert c.allocator.num_free == 64 - 4
    events = []
    for _ in range(200):                    # 2 s of 10 ms steps on the test clock
        events += c.step()
        if c.receiver.state("slow") == TransferState.FAILED:
            break
    assert [e.request_id for e in events if isinstance(e, TransferFailed)] == ["slow"]
    assert "timed out" in next(e.reason for e in events if isinstance(e, TransferFailed))
    assert c.allocator.num_free == 64
    # the sender learns of it through the Abort the receiver sent
    assert c.senders[0].state("slow", 0) == TransferState.FAILED


def _grants(envelopes):
    return [env.msg for env in envelopes if isinstance(env.msg, Grant)]


def test_credit_window_streams_several_pieces_per_control_round_trip():
    # 128 B per token (2 x Hkv 2 x D 8 x fp32); 4 slots of 256 B: 2 tokens per piece, so a
    # 16-token layer is 8 pieces and the receiver may hand out all 4 slots at once.
    cfg = TransferConfig(num_backends=1, pool_size=1, backend_buffer_bytes=1024, backend_slots=4,
                         send_buffer_bytes=1024, bulk_chunk_bytes=1024)
    c = Cluster(1, cfg)
    kv = source_kv(16, seed=6)
    _add(c, 0, "r", 0, (0, 16), [(0, 16)], 16, kv=kv, layers=[0])
    for env in c.senders[0].drain_outbox():
        c.receiver.deliver(env.msg, c.now)
    c.receiver.poll(c.now)
    grants = _grants(c.receiver.drain_outbox())
    assert sorted(g.slot for g in grants) == [0, 1, 2, 3]
    assert sorted(g.offset for g in grants) == [0, 256, 512, 768]
    assert all(g.max_piece_bytes == 256 for g in grants)
    for g in grants:
        c.senders[0].deliver(g, c.now)
    # No further grant reaches the sender: it still writes four pieces, one per credit.
    for _ in range(8):
        c.senders[0].poll(c.now)
        c.receiver.poll(c.now)
    req = c.receiver.requests["r"]
    assert int(req.coverage[0].sum()) == 8 and not req.coverage[1].any()
    # the receiver grants the used slots again: the rest of layer 0 (8 tokens = 4 pieces)
    assert sorted(g.slot for g in _grants(c.receiver.drain_outbox())) == [0, 1, 2, 3]
    assert c.receiver.requests["r"].shards[(0, 0)].outstanding == 4


def test_credits_never_exceed_the_computed_pieces():
    # 2-token shard: one piece per layer; with only layer 0 computed, one credit of four slots.
    cfg = TransferConfig(num_backends=1, pool_size=1, backend_buffer_bytes=1024, backend_slots=4,
                         send_buffer_bytes=1024, bulk_chunk_bytes=1024)
    c = Cluster(1, cfg)
    kv = source_kv(2, seed=7)
    pos = _add(c, 0, "r", 0, (0, 2), [(0, 2)], 2, kv=kv, layers=[0])
    for env in c.senders[0].drain_outbox():
        c.receiver.deliver(env.msg, c.now)
    c.receiver.poll(c.now)
    assert len(_grants(c.receiver.drain_outbox())) == 1
    c.receiver.poll(c.now)
    assert _grants(c.receiver.drain_outbox()) == []
    c.senders[0].layer_ready("r", 0, 1, kv[1][pos])
    for env in c.senders[0].drain_outbox():
        c.receiver.deliver(env.msg, c.now)
    c.receiver.poll(c.now)
    assert len(_grants(c.receiver.drain_outbox())) == 1


def test_abort_fences_only_the_slots_that_had_credits():
    cfg = TransferConfig(num_backends=1, pool_size=1, backend_buffer_bytes=1024, backend_slots=4,
                         send_buffer_bytes=1024, bulk_chunk_bytes=1024, abort_grace_s=0.5)
    c = Cluster(1, cfg)
    kv = source_kv(4, seed=8)
    _add(c, 0, "r", 0, (0, 4), [(0, 4)], 4, kv=kv, layers=[0])   # 2 pieces computed: 2 credits
    for env in c.senders[0].drain_outbox():
        c.receiver.deliver(env.msg, c.now)
    c.receiver.poll(c.now)
    backend = c.receiver.backends[0]
    assert sorted(backend.credits) == [0, 1]
    c.receiver.abort("r", "client gone", c.now)
    assert backend.credits == {} and sorted(backend.fenced) == [0, 1]
    assert backend.free_slots(c.now) == [2, 3]
    assert backend.free_slots(c.now + 0.5) == [0, 1, 2, 3] and backend.fenced == {}


def test_backend_slots_are_validated():
    with pytest.raises(ValueError, match="backend_slots"):
        TransferConfig(backend_slots=0)
    with pytest.raises(ValueError, match="exceeds"):
        TransferConfig(backend_buffer_bytes=2, backend_slots=4)
