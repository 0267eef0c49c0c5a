"""Lockstep of a decode instance's TP ranks without a Ray call per rank per round.

The driver calls rank 0 only (``DecodeRank.round``); rank 0 hands the round's commands to the
other ranks and collects their replies over a socket to each (the ranks of an instance share a
node: STRICT_PACK placement), the way vLLM's multiprocessing executor broadcasts its
scheduler output:

1. ``init_group`` forms the instance's gloo world and loads the model; then rank 0 listens
   (``Leader.open``), tells the others its address with one broadcast over the world, and
   accepts one connection per follower; each rank > 0 connects, says its rank and starts a
   ``Follower`` thread that waits in a blocking receive.
2. A round: rank 0 sends ``("step", commands)`` to every follower; every rank applies them and
   steps its engine (the model's all-reduces, on the gloo world, keep the steps together);
   each follower sends its ``StepReply`` back; rank 0 returns all replies, in rank order, to
   the driver: one Ray call per round whatever the TP size, and per round two socket writes
   and reads per follower instead of a Ray call to each rank.
3. Idle: a follower blocks in ``recv`` (no CPU, and a socket has no timeout to run out,
   unlike a gloo receive). Only rank 0's wait for replies has one (``timeout_s``).
4. ``stop``: rank 0 sends ``("stop",)`` and each follower's thread ends.

Failures: a follower that died closes its socket, so rank 0's send or receive fails at once;
``round`` raises ``LockstepBroken``, the driver's round fails and the instance breaks as
before (every request fails with ``DecodeInstanceLost`` and the dispatcher runs it again). A
follower whose step raised sends a ``RankFailed`` instead of its reply, and rank 0 raises it.
When rank 0 dies the followers' receive ends and their threads end; the driver's call to rank
0 fails. Frames are a length (8 bytes, big-endian) and a pickle of plain messages.
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
from collections.abc import Callable

import msgspec
import torch.distributed as dist

from tetris.actors.decode.messages import Command, StepReply

__all__ = ["Follower", "Leader", "LockstepBroken", "RankFailed"]

log = logging.getLogger(__name__)

Step = Callable[[list[Command]], StepReply]
_LENGTH = struct.Struct("!Q")


class RankFailed(msgspec.Struct, frozen=True):
    """A follower's step raised: sent in its reply's place."""

    rank: int
    error: str


class LockstepBroken(RuntimeError):
    """A rank of the lockstep died or failed a step: the instance must be restarted."""


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("the other rank closed the lockstep connection")
        buf += part
    return bytes(buf)


def _recv(sock: socket.socket):
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    return pickle.loads(_recv_exact(sock, n))   # our own ranks' frames only


def _nodelay(sock: socket.socket) -> socket.socket:
    # one small frame each way per round: Nagle's algorithm would hold it for an ACK
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Leader:
    """Rank 0's side: one round at a time."""

    def __init__(self, followers: list[socket.socket], step: Step, timeout_s: float) -> None:
        self._followers, self._step, self.timeout_s = followers, step, timeout_s
        self._lock = threading.Lock()   # ``stop`` may come beside a round
        self._broken: BaseException | None = None

    @classmethod
    def open(cls, host: str, tp_size: int, step: Step, timeout_s: float) -> Leader:
        """Listen, tell the followers where (a broadcast over the world), accept them all."""
        with socket.create_server((host, 0)) as server:
            dist.broadcast_object_list([server.getsockname()[:2]], src=0)
            server.settimeout(timeout_s)
            by_rank: dict[int, socket.socket] = {}
            while len(by_rank) < tp_size - 1:
                conn, _ = server.accept()
                conn.settimeout(timeout_s)
                by_rank[_recv(_nodelay(conn))] = conn
        if sorted(by_rank) != list(range(1, tp_size)):
            raise RuntimeError(f"lockstep followers {sorted(by_rank)}, expected 1..{tp_size - 1}")
        return cls([by_rank[r] for r in sorted(by_rank)], step, timeout_s)

    def round(self, commands: list[Command]) -> list[StepReply]:
        """Every rank's reply to ``commands``, in rank order; ``LockstepBroken`` if a rank is
        gone or failed (this and every later round)."""
        with self._lock:
            if self._broken is not None:
                raise LockstepBroken(f"lockstep broken: {self._broken}") from self._broken
            try:
                for sock in self._followers:
                    _send(sock, ("step", commands))
                replies = [self._step(commands)]
                replies += [_recv(sock) for sock in self._followers]
            except Exception as e:
                self._broken = e
                raise LockstepBroken(f"lockstep round failed: {e!r}") from e
            failed = [r for r in replies if isinstance(r, RankFailed)]
            if failed:
                self._broken = LockstepBroken(f"TP rank {failed[0].rank} failed a step: "
                                              f"{failed[0].error}")
                raise self._broken
            return replies

    def stop(self) -> None:
        """End the followers' loops (best effort: a dead follower cannot be told)."""
        with self._lock:
            for sock in self._followers:
                try:
                    if self._broken is None:
                        _send(sock, ("stop",))
                except OSError as e:
                    log.warning("lockstep: could not stop a follower: %s", e)
                finally:
                    sock.close()
            self._broken = LockstepBroken("lockstep stopped")


class Follower:
    """A rank > 0: a thread that receives rank 0's commands, steps, and sends its reply."""

    def __init__(self, sock: socket.socket, tp_rank: int, step: Step) -> None:
        self._sock, self._rank, self._step = sock, tp_rank, step
        self.rounds = 0   # rounds run from rank 0's frames
        self.error: BaseException | None = None   # why the loop ended, if not a stop
        self._thread = threading.Thread(target=self._loop, name=f"lockstep-rank-{tp_rank}",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, tp_rank: int, step: Step, timeout_s: float) -> Follower:
        """Learn rank 0's address (its broadcast over the world), connect, say who this is."""
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        sock = _nodelay(socket.create_connection(tuple(box[0]), timeout=timeout_s))
        _send(sock, tp_rank)
        sock.settimeout(None)   # idle for as long as rank 0 is: a blocking receive, no timeout
        return cls(sock, tp_rank, step)

    def join(self, timeout_s: float) -> bool:
        """Wait for the loop to end (after rank 0's stop); whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self) -> None:
        self._sock.close()

    def _loop(self) -> None:
        try:
            while True:
                kind, *rest = _recv(self._sock)
                if kind == "stop":
                    return
                self.rounds += 1
                try:
                    reply: StepReply | RankFailed = self._step(rest[0])
                except Exception as e:  # reported to rank 0, which breaks
                    log.exception("TP rank %d: step failed", self._rank)
                    reply = RankFailed(self._rank, repr(e))
                _send(self._sock, reply)
        except Exception as e:  # noqa: BLE001 - rank 0 died or closed the connection
            self.error = e
            log.warning("TP rank %d: lockstep loop ended: %s", self._rank, e)
