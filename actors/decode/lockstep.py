"""Lockstep of a decode instance's TP ranks without a Ray call per rank per round.

The driver calls rank 0 only (``DecodeRank.round``); rank 0 hands the round's commands to the
other ranks over a gloo group of their own and collects their replies over it, the way vLLM's
multiprocessing executor broadcasts its scheduler output:

1. ``init_group`` forms the instance's world, then this lockstep group on every rank (one
   ``new_group``, same order everywhere). Rank 0 keeps a ``Leader``; every other rank starts
   a ``Follower`` thread that waits in the group's broadcast.
2. A round: rank 0 broadcasts ``("step", commands)``; every rank applies them and steps its
   engine (the model's all-reduces, on the world group, keep the steps together); the
   followers send their ``StepReply`` back with one gather; rank 0 returns all replies, in
   rank order, to the driver: one Ray call per round, whatever the TP size.
3. Idle: a follower blocks in a receive (a wait, not a spin: no CPU). So that no receive
   outlives the group's timeout, rank 0 sends a ``("noop",)`` once a ``keepalive_s`` without
   a round (a quarter of the timeout).
4. ``stop``: rank 0 broadcasts ``("stop",)`` and each follower's thread ends.

Failures: a follower that died closes its sockets, so rank 0's broadcast or gather raises at
once; ``round`` raises, the driver's round fails and the instance breaks as before (every
request fails with ``DecodeInstanceLost`` and the dispatcher runs it again). A keepalive that
fails is kept and raised by the next round. A follower whose step raised still sends a
``RankFailed`` in the gather (no rank is left waiting), and rank 0 raises it. When rank 0
dies, the followers' receive raises and their threads end; the driver's call to rank 0 fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import msgspec
import torch.distributed as dist

from tetris.actors.decode.messages import Command, StepReply

__all__ = ["Follower", "Leader", "LockstepBroken", "RankFailed", "new_lockstep_group"]

log = logging.getLogger(__name__)

Step = Callable[[list[Command]], StepReply]


class RankFailed(msgspec.Struct, frozen=True):
    """A follower's step raised: sent in its reply's place."""

    rank: int
    error: str


class LockstepBroken(RuntimeError):
    """A rank of the lockstep group died or failed a step: the instance must be restarted."""


def new_lockstep_group(timeout_s: float):
    """The lockstep group (all ranks of the world; call on every rank in the same order)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class Leader:
    """Rank 0's side: one round at a time (a lock shared with the keepalive thread)."""

    def __init__(self, group, tp_size: int, step: Step, timeout_s: float) -> None:
        self._group, self._tp_size, self._step = group, tp_size, step
        self.keepalive_s = timeout_s / 4
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._broken: BaseException | None = None
        self._stopped = threading.Event()
        self._keeper = threading.Thread(target=self._keep_alive, name="lockstep-keepalive",
                                         daemon=True)
        self._keeper.start()

    def round(self, commands: list[Command]) -> list[StepReply]:
        """Every rank's reply to ``commands``, in rank order; ``LockstepBroken`` if a rank is
        gone or failed (this and every later round)."""
        with self._lock:
            self._check()
            try:
                self._send(("step", commands))
                mine = self._step(commands)
                replies: list = [None] * self._tp_size
                dist.gather_object(mine, replies, dst=0, group=self._group)
            except Exception as e:
                self._broken = e
                raise LockstepBroken(f"lockstep round failed: {e}") from e
            finally:
                self._last = time.monotonic()
            failed = [r for r in replies if isinstance(r, RankFailed)]
            if failed:
                self._broken = LockstepBroken(f"TP rank {failed[0].rank} failed a step: "
                                              f"{failed[0].error}")
                raise self._broken
            return replies

    def stop(self) -> None:
        """End the followers' loops (best effort: a dead follower cannot be told)."""
        self._stopped.set()
        with self._lock:
            if self._broken is None:
                try:
                    self._send(("stop",))
                except Exception as e:  # noqa: BLE001 - shutting down anyway
                    log.warning("lockstep: could not stop the followers: %s", e)
            self._broken = LockstepBroken("lockstep stopped")

    def _check(self) -> None:
        if self._broken is not None:
            raise LockstepBroken(f"lockstep broken: {self._broken}") from self._broken

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self._group)

    def _keep_alive(self) -> None:
        # Wakes a few times per keepalive period; sends only after a period without a round.
        while not self._stopped.wait(self.keepalive_s / 4):
            with self._lock:
                if self._broken is not None:
                    return
                if time.monotonic() - self._last < self.keepalive_s:
                    continue
                try:
                    self._send(("noop",))
                except Exception as e:  # noqa: BLE001 - the next round raises it
                    log.error("lockstep keepalive failed (a follower died?): %s", e)
                    self._broken = e
                    return
                self._last = time.monotonic()


class Follower:
    """A rank > 0: a thread that receives rank 0's commands, steps, and sends its reply."""

    def __init__(self, group, tp_rank: int, step: Step) -> None:
        self._group, self._rank, self._step = group, tp_rank, step
        self.rounds = 0   # rounds run from rank 0's broadcast
        self.error: BaseException | None = None   # why the loop ended, if not a stop
        self._thread = threading.Thread(target=self._loop, name=f"lockstep-rank-{tp_rank}",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait for the loop to end (after rank 0's stop); whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while True:
                box: list = [None]
                dist.broadcast_object_list(box, src=0, group=self._group)
                kind, *rest = box[0]
                if kind == "stop":
                    return
                if kind != "step":
                    continue   # a keepalive
                self.rounds += 1
                try:
                    reply: StepReply | RankFailed = self._step(rest[0])
                except Exception as e:  # reported to rank 0, which breaks
                    log.exception("TP rank %d: step failed", self._rank)
                    reply = RankFailed(self._rank, repr(e))
                dist.gather_object(reply, None, dst=0, group=self._group)
        except Exception as e:  # noqa: BLE001 - rank 0 died or the group broke
            self.error = e
            log.warning("TP rank %d: lockstep loop ended: %s", self._rank, e)
