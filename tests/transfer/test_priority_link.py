"""Activations before bulk KV on a real socket: order at chunk boundaries, bytes intact."""

import os
import socket

import pytest
from tetris.transfer.priority_link import PriorityLink, receive_chunks
from tetris.transfer.traffic import TrafficClass

CHUNK = 4096


def _run(fifo: bool, act_after_bulk_chunks: int):
    a, b = socket.socketpair()
    bulk = os.urandom(8 * CHUNK + 100)          # 9 chunks, the last one short
    act = os.urandom(3000)
    sent = []

    def on_sent(item, last):
        sent.append(item)
        if item == 0 and len(sent) == act_after_bulk_chunks:
            link.submit("act", act, TrafficClass.ACTIVATION)   # ready mid-bulk

    link = PriorityLink(a, CHUNK, fifo=fifo, on_sent=on_sent)
    link.submit("kv", bulk, TrafficClass.BULK)
    link.start()
    link.close()
    a.shutdown(socket.SHUT_WR)
    order, got = [], {0: bytearray(len(bulk)), 1: bytearray(len(act))}
    buf = bytearray(CHUNK)
    for item, offset, n, cls, _last in receive_chunks(b, buf):
        order.append(item)
        got[item][offset:offset + n] = buf[:n]
        assert cls == (TrafficClass.BULK if item == 0 else TrafficClass.ACTIVATION)
    a.close(), b.close()
    assert bytes(got[0]) == bulk and bytes(got[1]) == act
    return order


@pytest.mark.parametrize("after", [1, 3, 8])
def test_a_ready_activation_goes_at_the_next_chunk_boundary(after):
    order = _run(fifo=False, act_after_bulk_chunks=after)
    assert order.index(1) == after            # waited for no chunk beyond the one on the wire
    assert order.count(0) == 9


def test_without_priority_the_activation_waits_for_the_whole_bulk():
    order = _run(fifo=True, act_after_bulk_chunks=1)
    assert order == [0] * 9 + [1]
