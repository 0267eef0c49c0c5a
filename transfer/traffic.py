"""Traffic classes on one link: activations before bulk KV (KunServe's coordinated exchange).

Activation transfers are small and on the critical path of a pipeline or a ring; bulk KV is
large and can wait. Bulk is cut into chunks of ``bulk_chunk_bytes``; the link carries one
chunk at a time and, at every chunk boundary, takes a waiting activation first. So an
activation submitted while bulk is running waits for at most the one chunk already on the
wire (``research/kunserve-notes.md`` §1.3: chunk time about one pipeline stage).

Pure bookkeeping, no I/O: the owner asks ``next()`` what to put on the wire, does it, and
reports ``finish()``. ``fifo=True`` turns the priority off (the uncoordinated baseline).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque

import msgspec

__all__ = ["TrafficClass", "LinkChunk", "LinkScheduler"]


class TrafficClass(enum.IntEnum):
    ACTIVATION = 0   # lower value goes first
    BULK = 1


class LinkChunk(msgspec.Struct, frozen=True):
    """One unit on the wire: bytes ``[offset, offset + nbytes)`` of item ``tag``."""

    tag: str
    traffic_class: TrafficClass
    offset: int
    nbytes: int
    last: bool        # the item's final chunk
    seq: int          # submission order, for deterministic FIFO within a class


class LinkScheduler:
    def __init__(self, bulk_chunk_bytes: int, *, fifo: bool = False) -> None:
        if bulk_chunk_bytes <= 0:
            raise ValueError(f"bulk_chunk_bytes must be positive, got {bulk_chunk_bytes}")
        self.bulk_chunk_bytes = bulk_chunk_bytes
        self.fifo = fifo
        self._queues: dict[TrafficClass, deque[LinkChunk]] = {c: deque() for c in TrafficClass}
        self._fifo: deque[LinkChunk] = deque()
        self._seq = itertools.count()
        self.in_flight: LinkChunk | None = None

    def submit(self, tag: str, nbytes: int, traffic_class: TrafficClass) -> list[LinkChunk]:
        """Queue an item; bulk is split into chunks, an activation always stays whole."""
        if nbytes <= 0:
            raise ValueError(f"{tag}: a transfer needs a positive size, got {nbytes}")
        step = self.bulk_chunk_bytes if traffic_class == TrafficClass.BULK else nbytes
        seq = next(self._seq)
        offsets = list(range(0, nbytes, step))
        chunks = [LinkChunk(tag=tag, traffic_class=traffic_class, offset=o, nbytes=min(step, nbytes - o),
                            last=o + step >= nbytes, seq=seq) for o in offsets]
        target = self._fifo if self.fifo else self._queues[traffic_class]
        target.extend(chunks)
        return chunks

    def pending(self, traffic_class: TrafficClass | None = None) -> int:
        if traffic_class is None:
            return len(self._fifo) + sum(len(q) for q in self._queues.values())
        return sum(1 for c in self._fifo if c.traffic_class == traffic_class) + len(self._queues[traffic_class])

    def next(self) -> LinkChunk | None:
        """The chunk to put on the wire now, or None when busy or idle-with-nothing-queued."""
        if self.in_flight is not None:
            return None
        queue = self._fifo if self.fifo else next((q for c, q in sorted(self._queues.items()) if q), None)
        if not queue:
            return None
        self.in_flight = queue.popleft()
        return self.in_flight

    def finish(self, chunk: LinkChunk) -> None:
        if self.in_flight != chunk:
            raise ValueError(f"finish({chunk.tag}@{chunk.offset}) but the link carries {self.in_flight}")
        self.in_flight = None

    def cancel(self, tag: str) -> int:
        """Drop queued chunks of ``tag`` (an aborted request); returns how many."""
        dropped = 0
        for queue in [self._fifo, *self._queues.values()]:
            keep = [c for c in queue if c.tag != tag]
            dropped += len(queue) - len(keep)
            queue.clear()
            queue.extend(keep)
        return dropped
