"""A KunServe pipeline's activation hop over a real link, sharing it with bulk KV.

``LinkHop`` is what ``PipelineRunner.hop`` calls between two members: the hidden states
[T, H] go over a socket as one ``ACTIVATION`` item of a ``PriorityLink`` and are rebuilt on
the other end (same dtype, shape and bytes). ``bulk`` puts a bulk transfer (a KV exchange, a
prefill KV stream) on the same link; the link sends the activation at the next bulk chunk
boundary, so a decode step waits for at most one chunk, not for the exchange.

One receiver thread reads every chunk off the link: activation items are handed to the
waiting ``__call__``, bulk bytes are written into the destination buffer given to ``bulk``.
In process both ends are here; across members the receiving half runs on the next member.

Lifecycle: ``LinkHop(chunk_bytes)`` starts the sender and the receiver; ``close()`` stops
both (queued bytes are sent first).
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading

import numpy as np
import torch
from tetris.transfer.priority_link import HEADER, PriorityLink
from tetris.transfer.traffic import TrafficClass

__all__ = ["LinkHop", "read_exact"]


def read_exact(sock: socket.socket, n: int) -> bytearray | None:
    """The next ``n`` bytes off the socket, or None once the peer has closed it (a link's
    reader thread: the chunk header, then its payload)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


class LinkHop:
    def __init__(self, bulk_chunk_bytes: int = 64 << 10) -> None:
        self._send, self._recv = socket.socketpair()
        self.link = PriorityLink(self._send, bulk_chunk_bytes, on_sent=self._on_sent)
        self._chunks_sent = 0
        self._submitted_at: dict[int, int] = {}
        self.waited_chunks: list[int] = []   # per activation: chunks sent after it was ready
        self.bulk_queued_at_hop: list[int] = []   # per activation: bulk chunks queued then
        self._arrived: queue.Queue[tuple[int, bytearray]] = queue.Queue()
        self._bulk: dict[int, tuple[memoryview, threading.Event]] = {}
        self._lock = threading.Lock()
        self.order: list[tuple[int, TrafficClass]] = []     # chunks as received
        self.activation_bytes = 0
        self._hops = itertools.count()
        self.link.start()
        self._reader = threading.Thread(target=self._receive, name="link-hop-rx", daemon=True)
        self._reader.start()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Send ``hidden`` to the next member; what arrives there, as a tensor."""
        src = hidden.detach().contiguous().cpu()
        raw = src.view(torch.uint8).numpy().reshape(-1)
        mark = self._chunks_sent
        self.bulk_queued_at_hop.append(self.link.scheduler.pending(TrafficClass.BULK))
        item = self.link.submit(f"act{next(self._hops)}", raw.data, TrafficClass.ACTIVATION)
        self._submitted_at[item] = mark
        got, payload = self._arrived.get()
        if got != item:
            raise RuntimeError(f"activation {got} arrived while {item} was awaited")
        self.activation_bytes += len(payload)
        out = torch.frombuffer(payload, dtype=torch.uint8).view(src.dtype).view(src.shape)
        return out.to(hidden.device)

    def _on_sent(self, item: int, last: bool) -> None:
        """Sender thread, after each chunk: how many chunks an activation let go first (one
        at most: the chunk on the wire when it became ready)."""
        mark = self._submitted_at.pop(item, None)
        if mark is not None:
            self.waited_chunks.append(self._chunks_sent - mark)
        self._chunks_sent += 1

    def bulk(self, tag: str, payload: np.ndarray, dest: np.ndarray) -> threading.Event:
        """Send ``payload``'s bytes into ``dest`` as bulk; the event is set when all arrived."""
        if payload.nbytes != dest.nbytes:
            raise ValueError(f"{tag}: {payload.nbytes} bytes into a {dest.nbytes}-byte buffer")
        done = threading.Event()
        with self._lock:            # registered before its first chunk can arrive
            item = self.link.submit(tag, payload.reshape(-1).view(np.uint8).data,
                                    TrafficClass.BULK)
            self._bulk[item] = (memoryview(dest.reshape(-1).view(np.uint8)), done)
        return done

    def _receive(self) -> None:
        while (head := read_exact(self._recv, HEADER.size)) is not None:
            item, offset, nbytes, cls, last = HEADER.unpack(head)
            body = read_exact(self._recv, nbytes)
            if body is None:
                return
            self.order.append((item, TrafficClass(cls)))
            if cls == TrafficClass.ACTIVATION:
                self._arrived.put((item, body))      # activations are never split
                continue
            with self._lock:
                dest, done = self._bulk[item]
            dest[offset:offset + nbytes] = body
            if last:
                done.set()

    def close(self) -> None:
        self.link.close()
        self._send.shutdown(socket.SHUT_WR)
        self._reader.join()
        self._send.close()
        self._recv.close()
