"""The elastic world's link: a full mesh of TCP connections for q and partials.

Elastic decode's messages are small and on the critical path of every layer (a master waits
for its holders' partials before its o_proj). On this project's CPU machines a gloo send/recv
pair in one direction took about 1 ms to complete (32 layers x 2 one-way exchanges: 64 ms a
round), a plain TCP socket with ``TCP_NODELAY`` read by the waiting thread itself about 30 µs
(1.9 ms a round), measured side by side with the same message pattern. So the world is plain
sockets: ``isend`` writes at once (header: tag, byte count; then the tensor's bytes) and
``irecv`` returns a work whose ``wait`` reads the next message from that peer. Messages
between two members arrive in the order sent, so waits must follow the posting order per peer
(``ElasticRows._exchange`` waits sends, then receives by peer and tag, as posted).

A send larger than ``INLINE_BYTES`` goes on a thread of its own, so that two members sending
each other more than the sockets buffer cannot both block in ``sendall``.

Tensors on a GPU go through host memory (a copy each way), as gloo needs them to
(``actors/collectives.py`` ``StagedLink``): sockets read and write host bytes only.

Rendezvous through a torch ``Store`` (each member publishes ``host:port``); member i connects
to every lower member and accepts every higher one.
"""

from __future__ import annotations

import socket
import struct
import threading

import torch

__all__ = ["INLINE_BYTES", "PeerLost", "SocketWorld"]

INLINE_BYTES = 1 << 20        # larger sends leave on a thread
_BUFFER_BYTES = 8 << 20
_HEADER = struct.Struct("!iq")  # tag, payload bytes


class PeerLost(RuntimeError):
    """A member's connection closed or failed (``ElasticRows`` loses that peer)."""


class _Done:
    def __init__(self, error: BaseException | None = None,
                 thread: threading.Thread | None = None) -> None:
        self.error, self.thread = error, thread

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise PeerLost(str(self.error)) from self.error


class _Recv:
    def __init__(self, world: SocketWorld, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.world, self.tensor, self.peer, self.tag = world, tensor, peer, tag

    def wait(self) -> None:
        self.world._read(self.tensor, self.peer, self.tag)


class SocketWorld:
    """Member ``index`` of ``size``; ``store`` a torch Store all members share."""

    def __init__(self, store, index: int, size: int, host: str = "127.0.0.1",
                 timeout_s: float = 60.0) -> None:
        if not 0 <= index < size:
            raise ValueError(f"member {index} outside a world of {size}")
        self.index, self.size = index, size
        self._store = store   # member 0 serves it: kept until every member has read it
        self._socks: dict[int, socket.socket] = {}
        with socket.create_server((host, 0)) as server:
            server.settimeout(timeout_s)
            store.set(f"elastic/{index}", f"{host}:{server.getsockname()[1]}")
            for peer in range(index):
                peer_host, port = store.get(f"elastic/{peer}").decode().rsplit(":", 1)
                sock = socket.create_connection((peer_host, int(port)), timeout=timeout_s)
                sock.sendall(_HEADER.pack(index, 0))
                self._socks[peer] = sock
            for _ in range(size - 1 - index):
                sock, _ = server.accept()
                sock.settimeout(timeout_s)
                self._socks[self._recv_header(sock)[0]] = sock
        for sock in self._socks.values():
            sock.settimeout(timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
        self._send_locks = {p: threading.Lock() for p in self._socks}
        self._queued: dict[int, threading.Thread] = {}   # per peer: its last threaded send

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> _Done:
        data = _bytes(tensor)
        message = (_HEADER.pack(tag, len(data)), data)
        done = _Done()
        before = self._queued.get(peer)
        if len(data) > INLINE_BYTES or (before is not None and before.is_alive()):
            # on a thread, after this peer's earlier threaded send: the order stays the posting
            done.thread = threading.Thread(target=self._send, args=(peer, message, done, before),
                                           daemon=True)
            self._queued[peer] = done.thread
            done.thread.start()
        else:
            self._send(peer, message, done)
        return done

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> _Recv:
        return _Recv(self, tensor, peer, tag)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks = {}
        self._store = None

    def _send(self, peer: int, message, done: _Done,
              after: threading.Thread | None = None) -> None:
        if after is not None:
            after.join()
        try:
            with self._send_locks[peer]:
                for part in message:
                    self._socks[peer].sendall(part)
        except (OSError, KeyError) as e:
            done.error = e

    def _read(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        try:
            sock = self._socks[peer]
            got_tag, nbytes = self._recv_header(sock)
            # a GPU tensor is filled from a host copy (sockets read host bytes)
            host = tensor if tensor.device.type == "cpu" else torch.empty(
                tensor.shape, dtype=tensor.dtype)
            view = memoryview(host.view(torch.uint8).reshape(-1).numpy())
            if got_tag != tag or nbytes != len(view):
                raise PeerLost(f"member {peer} sent tag {got_tag} of {nbytes} bytes where tag "
                               f"{tag} of {len(view)} bytes was expected")
            _recv_into(sock, view)
            if host is not tensor:
                tensor.copy_(host)
        except (OSError, KeyError) as e:
            raise PeerLost(f"member {peer}: {e!r}") from e

    @staticmethod
    def _recv_header(sock: socket.socket) -> tuple[int, int]:
        buf = bytearray(_HEADER.size)
        _recv_into(sock, memoryview(buf))
        return _HEADER.unpack(buf)


def _bytes(tensor: torch.Tensor) -> memoryview:
    host = tensor.detach().cpu()   # a GPU tensor: its host copy (a no-op on the CPU)
    return memoryview(host.contiguous().reshape(-1).view(torch.uint8).numpy())


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    n = 0
    while n < len(view):
        got = sock.recv_into(view[n:])
        if got == 0:
            raise PeerLost("connection closed")
        n += got
