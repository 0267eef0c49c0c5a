"""Traffic classes: an activation submitted during a bulk transfer waits at most one bulk
chunk (counted in chunks, not wall time); without priority it waits for the whole bulk."""

from __future__ import annotations

import pytest
import torch
from transfer_helpers import HKV, LAYERS, D, Cluster, source_kv

from tetris.config import TransferConfig
from tetris.transfer.states import ActivationGo
from tetris.transfer.traffic import LinkScheduler, TrafficClass


def _chunks_waited(link: LinkScheduler, submit_after: int) -> int:
    """Run a 10-chunk bulk; submit an activation after ``submit_after`` chunks went on the
    wire; return how many bulk chunks finished between its submission and its start."""
    link.submit("kv", 10 * 1024, TrafficClass.BULK)
    started = 0
    waited = None
    while True:
        chunk = link.next()
        if chunk is None:
            break
        if chunk.traffic_class == TrafficClass.ACTIVATION:
            link.finish(chunk)
            continue
        started += 1
        if started == submit_after + 1:
            # the activation arrives while this bulk chunk is on the wire
            link.submit("act", 64, TrafficClass.ACTIVATION)
            waited = 0
        link.finish(chunk)
        if waited is not None and link.pending(TrafficClass.ACTIVATION):
            waited += 1
    return waited


@pytest.mark.parametrize("submit_after", [0, 3, 8])
def test_activation_waits_at_most_one_bulk_chunk(submit_after):
    assert _chunks_waited(LinkScheduler(1024), submit_after) == 1


def test_without_priority_the_activation_waits_for_the_rest_of_the_bulk():
    assert _chunks_waited(LinkScheduler(1024, fifo=True), 3) == 10 - 3


def test_link_splits_bulk_into_chunks_and_keeps_activations_whole():
    link = LinkScheduler(1000)
    chunks = link.submit("kv", 2500, TrafficClass.BULK)
    assert [(c.offset, c.nbytes, c.last) for c in chunks] == [(0, 1000, False), (1000, 1000, False), (2000, 500, True)]
    assert len(link.submit("act", 5000, TrafficClass.ACTIVATION)) == 1
    assert link.next().tag == "act"
    with pytest.raises(ValueError):
        link.submit("empty", 0, TrafficClass.BULK)


def test_send_manager_yields_to_an_activation_at_the_next_piece_boundary():
    cfg = TransferConfig(num_backends=1, pool_size=1, backend_buffer_bytes=1024, send_buffer_bytes=1024,
                         bulk_chunk_bytes=256)
    c = Cluster(1, cfg)
    kv = source_kv(32, seed=9)
    sender = c.senders[0]
    sender.add_shard(request_id="r", chunk_index=0, receiver_id=0, prompt_tokens=32, chunk=(0, 32),
                     ranges=[(0, 32)], num_layers=LAYERS, kv_heads=HKV, head_dim=D, dtype=torch.float32, now=0.0)
    for layer in range(LAYERS):
        sender.layer_ready("r", 0, layer, kv[layer])
    for _ in range(4):               # a few pieces of the 16-piece bulk go out
        c.step()
    pieces_before = int(c.receiver.requests["r"].coverage.sum())
    assert 0 < pieces_before < 2 * 32
    sender.submit_activation("hidden-states", 64)
    go = []
    for _ in range(3):
        c.step()
        go += [e for _, e in c.events if isinstance(e, ActivationGo)]
        if go:
            break
    assert [e.tag for e in go] == ["hidden-states"]
    # at most the one piece that was on the wire landed before the activation got the link
    assert int(c.receiver.requests["r"].coverage.sum()) - pieces_before <= 256 // (2 * HKV * D * 4)
    coverage = int(c.receiver.requests["r"].coverage.sum())
    c.step()
    assert int(c.receiver.requests["r"].coverage.sum()) == coverage   # bulk holds while the activation runs
    sender.finish_activation("hidden-states")
    for _ in range(2):
        c.step()
    assert int(c.receiver.requests["r"].coverage.sum()) > coverage
