"""The links between the members of a served KunServe group (issue #24), one per pair.

Each pair of members of a dropped group shares one TCP connection with a ``PriorityLink``
on each end (``transfer/priority_link.py``): a member's hidden states for the next stage go
as ``ACTIVATION`` items, the KV exchange and the layers pulled back at a restore as ``BULK``
items, cut into chunks, so a decode step's hop waits for at most one bulk chunk.

A message is a dict pickled whole into one link item (tensors inside keep their dtype and
shape); a reader thread per peer collects an item's chunks (bulk chunks of several items may
interleave with activations) and hands the finished message to ``on_message(peer, msg)``.

Lifecycle: 1. ``listen()`` on every member -> its address; 2. ``connect(addresses)`` on
every member at once: member j dials each member k < j and says its index, and accepts one
connection from each k > j; 3. ``send`` from any thread; 4. ``close()``.
"""

from __future__ import annotations

import itertools
import pickle
import socket
import struct
import threading
from collections.abc import Callable

from tetris.transfer.activation_hop import read_exact
from tetris.transfer.priority_link import HEADER, PriorityLink
from tetris.transfer.traffic import TrafficClass

__all__ = ["GroupLinks"]

_INDEX = struct.Struct("<Q")


class GroupLinks:
    def __init__(self, member: int, on_message: Callable[[int, dict], None], *,
                 bulk_chunk_bytes: int = 64 << 10) -> None:
        self.member = member
        self.on_message = on_message
        self.bulk_chunk_bytes = bulk_chunk_bytes
        self._server: socket.socket | None = None
        self._socks: dict[int, socket.socket] = {}
        self._links: dict[int, PriorityLink] = {}
        self._readers: list[threading.Thread] = []
        self._tags = itertools.count()
        self._lock = threading.Lock()
        self.sent_bytes = {c: 0 for c in TrafficClass}      # by traffic class
        self.sent_items = {c: 0 for c in TrafficClass}

    def listen(self, host: str) -> tuple[str, int]:
        self._server = socket.create_server((host, 0))
        return host, self._server.getsockname()[1]

    def connect(self, addresses: list[tuple[str, int]], timeout_s: float) -> None:
        """Dial every lower member, accept every higher one (all members call this at once)."""
        for k in range(self.member):
            sock = socket.create_connection(addresses[k], timeout=timeout_s)
            sock.sendall(_INDEX.pack(self.member))
            self._add(k, sock)
        self._server.settimeout(timeout_s)
        for _ in range(len(addresses) - self.member - 1):
            sock, _ = self._server.accept()
            sock.settimeout(None)
            head = read_exact(sock, _INDEX.size)
            if head is None:
                raise ConnectionError(f"member {self.member}: a peer closed before its index")
            self._add(_INDEX.unpack(head)[0], sock)
        self._server.close()
        self._server = None

    def _add(self, peer: int, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks[peer] = sock
        self._links[peer] = PriorityLink(sock, self.bulk_chunk_bytes)
        self._links[peer].start()
        reader = threading.Thread(target=self._receive, args=(peer, sock), daemon=True,
                                  name=f"kunserve-link-{self.member}-{peer}")
        self._readers.append(reader)
        reader.start()

    @property
    def peers(self) -> list[int]:
        return sorted(self._links)

    def send(self, peer: int, msg: dict, traffic_class: TrafficClass) -> None:
        payload = pickle.dumps(msg, protocol=5)
        with self._lock:
            tag = f"{traffic_class.name.lower()}{next(self._tags)}"
            self.sent_bytes[traffic_class] += len(payload)
            self.sent_items[traffic_class] += 1
        self._links[peer].submit(tag, payload, traffic_class)

    def pending_bulk_chunks(self, peer: int) -> int:
        """Bulk chunks queued on the link to ``peer`` (an activation sent now goes first)."""
        return self._links[peer].scheduler.pending(TrafficClass.BULK)

    def _receive(self, peer: int, sock: socket.socket) -> None:
        """Reader thread: whole messages to ``on_message``; ``None`` once the link broke."""
        parts: dict[int, list[bytearray]] = {}
        try:
            while (head := read_exact(sock, HEADER.size)) is not None:
                item, _offset, nbytes, _cls, last = HEADER.unpack(head)
                body = read_exact(sock, nbytes)
                if body is None:
                    break
                parts.setdefault(item, []).append(body)
                if last:
                    self.on_message(peer, pickle.loads(b"".join(parts.pop(item))))
        except OSError:
            pass   # reset by a dead peer: the same as its close
        self.on_message(peer, None)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        for sock in self._socks.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for reader in self._readers:
            reader.join(5.0)
        if self._server is not None:
            self._server.close()
        self._links.clear()
        self._socks.clear()
