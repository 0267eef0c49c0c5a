"""The first token travels with the KV (``FirstToken``): the receive manager reports it for a
reserved request before or after the KV completes, and not for a failed or unknown one."""

from __future__ import annotations

import torch
from transfer_helpers import HKV, LAYERS, D, Cluster, source_kv

from tetris.config import TransferConfig
from tetris.transfer.messages import Envelope, FirstToken, decode, encode
from tetris.transfer.states import FirstTokenIn, RequestReady

SMALL = TransferConfig(num_backends=2, pool_size=3, backend_buffer_bytes=1024, send_buffer_bytes=1024,
                       bulk_chunk_bytes=512, timeout_s=1.0, abort_grace_s=0.05)
PROMPT = 20


def _stream(c: Cluster, rid: str, kv, layers) -> None:
    c.senders[0].add_shard(request_id=rid, chunk_index=0, receiver_id=0, prompt_tokens=PROMPT,
                           chunk=(0, PROMPT), ranges=[(0, PROMPT)], num_layers=LAYERS, kv_heads=HKV,
                           head_dim=D, dtype=torch.float32, now=c.now)
    for layer in layers:
        c.senders[0].layer_ready(rid, 0, layer, kv[layer])


def _events_until_ready(c: Cluster, limit: int = 500) -> list:
    seen: list = []
    for _ in range(limit):
        seen.extend(c.step())
        if any(isinstance(e, RequestReady) for e in seen):
            return seen
    raise AssertionError("the request never completed")


def test_first_token_sent_before_the_last_layer_lands_is_reported_with_its_logprob():
    c = Cluster(1, SMALL)
    kv = source_kv(PROMPT, seed=1)
    try:
        assert c.receiver.reserve("r", PROMPT, c.now)
        _stream(c, "r", kv, range(LAYERS))
        c.senders[0].first_token("r", [0], 42, b"\x93\x2a")   # queued behind the handshake
        events = _events_until_ready(c)
        firsts = [e for e in events if isinstance(e, FirstTokenIn)]
        assert firsts == [FirstTokenIn(request_id="r", token=42, logprob=b"\x93\x2a")]
        # it overtook the last pieces: reported while the KV was still arriving
        assert events.index(firsts[0]) < next(i for i, e in enumerate(events)
                                              if isinstance(e, RequestReady))
    finally:
        c.close()


def test_first_token_after_the_kv_completed_is_still_reported():
    c = Cluster(1, SMALL)
    kv = source_kv(PROMPT, seed=2)
    try:
        assert c.receiver.reserve("r", PROMPT, c.now)
        _stream(c, "r", kv, range(LAYERS))
        assert not any(isinstance(e, FirstTokenIn) for e in _events_until_ready(c))
        assert "r" not in c.receiver.requests            # closed as done
        c.senders[0].first_token("r", [0], 7)
        assert c.step() == [FirstTokenIn(request_id="r", token=7)]
    finally:
        c.close()


def test_first_token_of_a_failed_or_unknown_request_is_dropped():
    c = Cluster(1, SMALL)
    kv = source_kv(PROMPT, seed=3)
    try:
        assert c.receiver.reserve("gone", PROMPT, c.now)
        _stream(c, "gone", kv, [0])
        c.step()
        c.receiver.abort("gone", "client left", c.now)
        c.senders[0].first_token("gone", [0], 5)
        c.senders[0].first_token("never-reserved", [0], 6)
        events = [e for _ in range(5) for e in c.step()]
        assert not any(isinstance(e, FirstTokenIn) for e in events)
    finally:
        c.close()


def test_first_token_goes_to_every_receiver_named_in_order_and_survives_msgpack():
    c = Cluster(1, SMALL)
    try:
        c.senders[0].first_token("r", [3, 1, 2], 9, b"lp")
        out = c.senders[0].drain_outbox()
        assert [e.dst_id for e in out] == [1, 2, 3]
        assert all(e.msg == FirstToken(request_id="r", sender_id=0, token=9, logprob=b"lp")
                   for e in out)
        assert decode(encode(out[0])) == Envelope(dst_role="receiver", dst_id=1, msg=out[0].msg)
    finally:
        c.close()
