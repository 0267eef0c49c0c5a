"""A byte link that carries activations before bulk KV: ``LinkScheduler`` put on a socket.

KunServe's coordinated exchange (§4.2): the KV exchange (and parameter pulls, and prefill KV
streams) share a link with a pipeline's activations. Bulk items are cut into chunks of
``bulk_chunk_bytes``; one sender thread puts one chunk at a time on the wire and asks the
scheduler for the next at every boundary, so a ready activation waits for at most the chunk
already being sent. ``fifo=True`` is the uncoordinated baseline (one queue in submit order).

Wire format, per chunk: a header ``<QQQB?`` (item id, offset, nbytes, traffic class, last)
then ``nbytes`` payload bytes. ``receive_chunks`` reads them back on the other end.

Lifecycle: 1. ``PriorityLink(sock, ...)``; 2. ``start()`` (the sender thread); 3. ``submit``
from any thread; 4. ``close()`` (sends what is queued, then stops).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator

from tetris.transfer.traffic import LinkScheduler, TrafficClass

__all__ = ["HEADER", "PriorityLink", "receive_chunks"]

HEADER = struct.Struct("<QQQB?")


class PriorityLink:
    def __init__(self, sock: socket.socket, bulk_chunk_bytes: int, *, fifo: bool = False,
                 on_sent: Callable[[int, bool], None] | None = None) -> None:
        self.sock = sock
        self.scheduler = LinkScheduler(bulk_chunk_bytes, fifo=fifo)
        self._payloads: dict[str, memoryview] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._ids: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self.on_sent = on_sent
        self.bytes_sent = 0

    def submit(self, tag: str, payload: memoryview | bytes, traffic_class: TrafficClass) -> int:
        """Queue ``payload`` under ``tag``; returns the item id that the receiver sees."""
        view = memoryview(payload).cast("B")
        with self._cond:
            item = len(self._ids)
            self._ids[tag] = item
            self._payloads[tag] = view
            self.scheduler.submit(tag, view.nbytes, traffic_class)
            self._cond.notify()
        return item

    def start(self) -> None:
        self._thread = threading.Thread(target=self._send_loop, name="priority-link",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                chunk = self.scheduler.next()
                while chunk is None:
                    if self._closing:
                        return
                    self._cond.wait()
                    chunk = self.scheduler.next()
                view = self._payloads[chunk.tag]
                item = self._ids[chunk.tag]
            body = view[chunk.offset:chunk.offset + chunk.nbytes]
            try:
                self.sock.sendall(HEADER.pack(item, chunk.offset, chunk.nbytes,
                                              int(chunk.traffic_class), chunk.last))
                self.sock.sendall(body)
            except OSError:   # the peer is gone: its reader's end tells the owner, not this
                with self._cond:
                    self._closing = True
                return
            self.bytes_sent += chunk.nbytes
            with self._cond:
                self.scheduler.finish(chunk)
                if chunk.last:
                    del self._payloads[chunk.tag]
            if self.on_sent is not None:
                self.on_sent(item, chunk.last)


def _read_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def receive_chunks(sock: socket.socket, buffer: bytearray) -> Iterator[tuple[int, int, int,
                                                                            TrafficClass, bool]]:
    """Chunks as they arrive: (item, offset, nbytes, class, last); the payload is read into
    ``buffer[:nbytes]`` (overwritten by the next chunk). Ends when the peer closes."""
    head = bytearray(HEADER.size)
    view = memoryview(buffer)
    while _read_exact(sock, memoryview(head)):
        item, offset, nbytes, cls, last = HEADER.unpack(head)
        if nbytes > len(buffer):
            raise ValueError(f"a {nbytes}-byte chunk does not fit the {len(buffer)}-byte buffer")
        if not _read_exact(sock, view[:nbytes]):
            return
        yield item, offset, nbytes, TrafficClass(cls), last
