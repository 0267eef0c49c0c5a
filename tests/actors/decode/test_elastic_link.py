"""The elastic world's socket link (actors/decode/elastic_link.py), three members on threads
of one process: tensors of several dtypes arrive intact in posting order; two members sending
each other more than the sockets buffer at once do not deadlock; a wrong tag and a closed
peer raise ``PeerLost`` (which ``ElasticRows`` turns into a lost peer)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from tetris.actors.decode.elastic_link import INLINE_BYTES, PeerLost, SocketWorld


def _worlds(size: int) -> list[SocketWorld]:
    store = dist.HashStore()
    worlds: list = [None] * size

    def join(i: int) -> None:
        worlds[i] = SocketWorld(store, i, size, "127.0.0.1", timeout_s=20.0)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(w is not None for w in worlds)
    return worlds


def _exchange(world: SocketWorld, sends: dict, recvs: dict, out: dict) -> None:
    works = [world.isend(t, p, tag) for p, ts in sorted(sends.items()) for tag, t in enumerate(ts)]
    got = {p: [torch.empty(s, dtype=d) for s, d in specs] for p, specs in sorted(recvs.items())}
    works += [world.irecv(t, p, tag) for p, ts in got.items() for tag, t in enumerate(ts)]
    for w in works:
        w.wait()
    out[world.index] = got


def _run(worlds, sends, recvs) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=_exchange, args=(w, sends[w.index], recvs[w.index], out))
               for w in worlds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert len(out) == len(worlds)
    return out


def test_messages_arrive_intact_and_large_ones_both_ways_do_not_deadlock():
    worlds = _worlds(3)
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(3, 4, 8, generator=g).to(torch.bfloat16)
        lse = torch.randn(4, 3, generator=g)
        keys = torch.tensor([7, 9], dtype=torch.int64)
        big = 2 * INLINE_BYTES // 4 + 5                 # float32 elements past the inline size
        a, b = torch.randn(big, generator=g), torch.randn(big, generator=g)
        sends = {0: {1: [q, lse], 2: [keys]}, 1: {0: [a]}, 2: {0: [torch.empty(0)]}}
        sends[0][1] += [b, q]   # 0 and 1 send each other 8 MB at once; a small one after
        recvs = {0: {1: [((big,), torch.float32)], 2: [((0,), torch.float32)]},
                 1: {0: [((3, 4, 8), torch.bfloat16), ((4, 3), torch.float32),
                         ((big,), torch.float32), ((3, 4, 8), torch.bfloat16)]},
                 2: {0: [((2,), torch.int64)]}}
        out = _run(worlds, sends, recvs)
        got_q, got_lse, got_b, got_q2 = out[1][0]
        assert torch.equal(got_q, q) and torch.equal(got_lse, lse) and torch.equal(got_b, b)
        assert torch.equal(got_q2, q)
        assert torch.equal(out[0][1][0], a) and out[0][2][0].numel() == 0
        assert torch.equal(out[2][0][0], keys)
    finally:
        for w in worlds:
            w.close()


def test_a_wrong_tag_or_a_closed_peer_is_peer_lost():
    w0, w1 = _worlds(2)
    try:
        w0.isend(torch.zeros(2), 1, 5).wait()
        with pytest.raises(PeerLost, match="tag 5"):
            w1.irecv(torch.empty(2), 0, 0).wait()
        w0.close()
        with pytest.raises(PeerLost):
            w1.irecv(torch.empty(2), 0, 0).wait()
    finally:
        w1.close()
