"""A dropped group's activation hops over a real link (``LinkHop``) while a bulk KV transfer
shares it: tokens, logprobs and top alternatives equal the single engine's bit for bit, every
hop's bytes went over the socket, the bulk arrived intact, and activations were not queued
behind the bulk (each went at the next chunk boundary after it was ready)."""

import numpy as np
import pytest
from tetris.transfer.activation_hop import LinkHop
from tetris.transfer.traffic import TrafficClass

from tests.engine.test_pipeline import (
    PROMPTS,
    _assert_same,
    _engine,
    _params,
    _reference,
    _run,
)
from tetris.engine.pipeline_group import drop

CHUNK = 16 << 10


@pytest.mark.parametrize("ranges", [[(0, 3), (3, 6)], [(0, 1), (1, 4), (4, 6)]],
                         ids=["2-stage", "3-stage"])
def test_pipeline_over_a_link_with_bulk_keeps_the_single_engines_tokens(ranges):
    params = _params(sampled=True)
    late = (list(range(60, 75)), params[0])
    expected = _reference(params, late)
    engines = [_engine() for _ in ranges]
    home, tokens = engines[0], {}
    for i, p in enumerate(PROMPTS):
        home.add_request(f"r{i}", p, params[i])
    _run([home], tokens, steps=3)
    group = drop(engines, ranges)
    hop = LinkHop(CHUNK)
    kv = np.random.default_rng(0).integers(0, 255, 32 << 20, dtype=np.uint8)  # 32 MiB "KV"
    dest = np.zeros_like(kv)
    arrived = []

    def hop_with_exchange(hidden):
        if not arrived:      # the exchange is queued on the link just before the first hop
            arrived.append(hop.bulk("kv-exchange", kv, dest))
        return hop(hidden)
    group.runner.hop = hop_with_exchange
    try:
        _run([home], tokens, steps=2)
        home.add_request("late", late[0], late[1])
        _run([home], tokens, steps=3)
        assert arrived[0].wait(timeout=60)
    finally:
        hop.close()
    runner = group.runner
    assert runner.activation_hops == 5 * (len(ranges) - 1)
    assert hop.activation_bytes == runner.activation_bytes > 0     # all over the socket
    assert np.array_equal(dest, kv)
    # each activation let at most the chunk already on the wire go first, never the queued
    # rest of the exchange (2048 chunks, queued when the first hop was ready)
    assert len(hop.waited_chunks) == runner.activation_hops
    assert max(hop.waited_chunks) <= 1
    assert hop.bulk_queued_at_hop[0] > 0
    kinds = [cls for _, cls in hop.order]
    assert kinds.count(TrafficClass.ACTIVATION) == runner.activation_hops
    assert kinds.count(TrafficClass.BULK) == kv.nbytes // CHUNK
    group.restore()
    _run(engines, tokens)
    _assert_same(tokens, expected)
