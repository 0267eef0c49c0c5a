"""Runs a send or receive manager inside a Ray actor, beside the actor's compute.

The managers (``tetris.transfer``) are poll-driven and never block; something has to deliver
their control messages, poll them and carry their outboxes to the peers. In an actor that
something is a ``TransferPump``: a daemon thread that, every ``interval_s`` while a write or a
piece is on the wire, every ``idle_interval_s`` while transfers wait on their peers (for the
timeouts), and otherwise only when woken, runs a round as soon as a message or an owner call
arrives:

1. delivers the messages that peers sent (``deliver``, called from a Ray method of the
   actor's ``"transfer"`` concurrency group, so it runs while a chunk or a decode step
   computes),
2. polls the manager (places arrived pieces, hands out grants, posts writes, checks timeouts),
3. sends each outbox envelope to its peer actor: ``peer.deliver_transfer.remote([msgs])``,
   one Ray call per peer and round, never waited on,
4. hands the round's events to ``on_events``.

An idle pump (the manager holds nothing: ``idle()``) blocks on its wake-up event with no
timeout, so an idle actor's pump costs nothing; whatever gives the manager work (``deliver``,
``locked``, ``connect`` when it gives up a replaced peer's work) sets that event, and the round
runs at once (``stop`` sets it too).

The owner reaches the manager only under the pump's lock (``with pump.locked() as mgr``), so
the compute thread (``add_shard``, ``layer_ready``, ``reserve``) and the pump never interleave
inside a manager. Peers are actor handles keyed by the manager's peer ids: receiver ids for a
sender, sender ids for a receiver.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tetris.transfer.messages import ControlMessage, Envelope
from tetris.transfer.states import TransferEvent

__all__ = ["TransferPump", "TRANSFER_GROUP"]

log = logging.getLogger(__name__)

# The Ray concurrency group of ``deliver_transfer`` methods: it must not wait behind a chunk.
TRANSFER_GROUP = "transfer"


class TransferPump:
    def __init__(self, manager: Any, *, name: str, interval_s: float = 0.001,
                 idle_interval_s: float = 0.05, on_events: Callable[[list[TransferEvent]], None] | None = None) -> None:
        self.manager = manager
        self.name = name
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.on_events = on_events
        self._lock = threading.RLock()
        self._inbox: list[ControlMessage] = []
        self._inbox_lock = threading.Lock()
        self._peers: dict[int, Any] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tetris-transfer-{name}")
        self.dropped = 0   # envelopes for peers this pump does not know (logged)

    # -- owner API ------------------------------------------------------------------------
    def start(self) -> TransferPump:
        self._thread.start()
        return self

    def connect(self, peers: dict[int, Any]) -> list[int]:
        """Add (or replace) peer actors, keyed by the manager's peer ids; returns the ids whose
        actor changed. A peer of None is a dead one not yet replaced: its messages are dropped.

        A new actor under a known id replaces a dead one (its owner restarted or replaced it):
        nothing the manager still expected from or for the dead actor can come any more, so it
        is given up now (``manager.peer_lost``), not when a timeout finds it. The requests a
        receiver gives up fail at once (and their other senders are told), so the dispatcher
        runs them again without waiting out the stall timeout."""
        with self._lock:
            replaced = sorted(i for i, p in peers.items() if i in self._peers and self._peers[i] != p)
            self._peers.update(peers)
            now = time.monotonic()
            for i in replaced:
                self.manager.peer_lost(i, now)
        if replaced:
            log.warning("%s: peers %s were replaced; what was under way with the old ones is "
                        "given up", self.name, replaced)
            self._wake.set()
        return replaced

    def deliver(self, msgs: Sequence[ControlMessage]) -> None:
        """Queue control messages from peers; the pump thread hands them to the manager."""
        with self._inbox_lock:
            self._inbox.extend(msgs)
        self._wake.set()

    @contextlib.contextmanager
    def locked(self) -> Iterator[Any]:
        """The manager, for the owner's calls; the pump runs a round right after."""
        with self._lock:
            yield self.manager
        self._wake.set()

    def pump_once(self) -> list[TransferEvent]:
        """One round (the thread's body; tests may call it directly)."""
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        with self._lock:
            now = time.monotonic()
            for msg in inbox:
                self.manager.deliver(msg, now)
            events = self.manager.poll(now)
            envelopes = self.manager.drain_outbox()
            peers = dict(self._peers)
        self._route(envelopes, peers)
        if events and self.on_events is not None:
            self.on_events(events)
        return events

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    # -- internals ------------------------------------------------------------------------
    def _route(self, envelopes: list[Envelope], peers: dict[int, Any]) -> None:
        by_peer: dict[int, list[ControlMessage]] = {}
        for env in envelopes:
            by_peer.setdefault(env.dst_id, []).append(env.msg)
        for dst in sorted(by_peer):
            peer = peers.get(dst)
            if peer is None:
                # The manager's own timeouts free whatever waited on this peer.
                self.dropped += len(by_peer[dst])
                log.warning("%s: no peer %d for %d message(s)", self.name, dst, len(by_peer[dst]))
                continue
            peer.deliver_transfer.remote(by_peer[dst])

    def _busy(self) -> bool:
        """Whether the manager must be polled soon (else the pump naps until woken).

        Managers say so themselves (``needs_polling``: a write on the wire, a piece that may
        land); messages and owner calls wake the pump anyway, and the idle nap still runs the
        timeouts. Polling every ``interval_s`` whenever anything was merely under way cost each
        actor ~10% of a core in the emulated cluster (16 prefill workers on 2 cores). Without
        ``needs_polling``: busy while any shard is unfinished or any request is held.
        """
        m = self.manager
        needs = getattr(m, "needs_polling", None)
        if needs is not None:
            return bool(needs())
        shards = getattr(m, "shards", None)
        if shards is not None:
            return any(not s.state.finished for s in shards.values())
        return bool(getattr(m, "requests", None))

    def _idle(self) -> bool:
        """Whether the manager holds nothing that time alone can move (no write on the wire, no
        transfer whose timeout runs): then the pump sleeps until woken. Only managers that say
        so (``idle()``) are trusted with that; any other keeps the ``idle_interval_s`` nap.

        The nap used to run regardless: 20 rounds a second in every prefill worker and decode
        rank of an idle server."""
        idle = getattr(self.manager, "idle", None)
        return bool(idle()) if idle is not None else False

    def _nap(self) -> float | None:
        """How long the thread may sleep before the next round (None: until woken)."""
        # Under the lock: the owner's threads add and drop shards meanwhile (reading the
        # manager unlocked once raised "dictionary changed size during iteration" here, outside
        # any handler, and the thread died: that sender's KV stalled).
        with self._lock:
            if self._busy():
                return self.interval_s
            return None if self._idle() else self.idle_interval_s

    def _run(self) -> None:
        while not self._stop.is_set():
            nap: float | None = self.interval_s
            try:
                self.pump_once()
                nap = self._nap()
            except Exception:  # noqa: BLE001 - a bad round must not kill the transfer thread
                log.exception("%s: transfer round failed", self.name)
            # Cleared before the next round reads the inbox and the manager, so a wake-up set
            # during that round is never lost (wait returns at once).
            self._wake.wait(nap)
            self._wake.clear()
