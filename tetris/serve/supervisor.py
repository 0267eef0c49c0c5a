"""The supervisor: keeps both pools serving while the dispatcher serves requests.

Every ``POLL_S`` while requests are in flight it pulls the decode instances' load into the
dispatcher's router (and the KV-usage gauges), takes broken decode instances out of routing
and restarts each in a task of its own (backoff 1, 2, 4, ... 60 s); and every
``prefill_check_s`` has the prefill pool replace workers that died idle. While no request is
in flight (and no restart under way) the decode rounds back off, doubling up to
``IDLE_POLL_S``: nothing changes the decode load then, and each round costs two Serve calls
and a ping to every decode rank (~3% of a core on an idle tiny deployment, docs/benchmarks.md
"Idle CPU"). The first request in flight brings them back to ``POLL_S`` within a tick.
The prefill probe backs off the same way, doubling from ``prefill_check_s`` up to
``IDLE_PREFILL_CHECK_S`` while idle (each probe is a Serve call and a ping to every prefill
worker), and is back at ``prefill_check_s`` within a tick of a request in flight; a worker
that died idle is still found by the first chunk that needs it (the request runs again).
A request that a death hits is the dispatcher's to run again; the supervisor only brings the
instances back.
"""

from __future__ import annotations

import asyncio
import logging

__all__ = ["Supervisor", "check_period", "actor_handles", "POLL_S", "IDLE_POLL_S",
           "IDLE_PREFILL_CHECK_S"]

log = logging.getLogger(__name__)

POLL_S = 0.5        # decode rounds while requests are in flight; the loop's tick
IDLE_POLL_S = 5.0   # the longest between decode rounds while none is
IDLE_PREFILL_CHECK_S = 32.0   # the longest between prefill probes while idle (if above the period)


def actor_handles(peers: dict) -> dict:
    """id -> actor handle, from a ``peers()`` table of id -> (handle, agent info)."""
    return {i: handle for i, (handle, _info) in peers.items()}


def check_period(seconds: float) -> float:
    seconds = float(seconds)
    if not seconds >= 0:
        raise ValueError(f"a health check period must be >= 0 s (0: off), got {seconds}")
    return seconds


class Supervisor:
    """Health checks and healing for one dispatcher's pools (their Serve handles)."""

    def __init__(self, dispatcher, metrics, prefill, decode, prefill_check_s: float) -> None:
        self.dispatcher, self.metrics = dispatcher, metrics
        self._prefill_h, self._decode_h = prefill, decode
        self.prefill_check_s = check_period(prefill_check_s)
        self._healing: dict[int, asyncio.Task] = {}   # decode instance -> its restart task
        self.restarts: dict[int, int] = {}            # decode instance -> restarts that succeeded
        self._prefill_healing: asyncio.Task | None = None
        self._last_prefill_check = 0.0
        self._prefill_backoff = 1   # idle probes so far double the period: 1, 2, 4, ...
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll_load())

    async def _poll_load(self) -> None:
        loop = asyncio.get_running_loop()
        period, last_round = POLL_S, -float("inf")
        while True:
            busy = self._busy()
            if busy or loop.time() - last_round >= period:
                await self._decode_round()
                last_round = loop.time()
                period = POLL_S if busy or self._busy() else min(IDLE_POLL_S, 2 * period)
            self._heal_prefill(busy or self._busy())
            await asyncio.sleep(POLL_S)

    def _busy(self) -> bool:
        """Requests in flight or a decode restart under way (local state: no remote call)."""
        if self._healing:
            return True
        try:
            return bool(self.dispatcher.stats().get("running"))
        except Exception:  # noqa: BLE001 - unknown: supervise as if busy
            return True

    async def _decode_round(self) -> None:
        try:
            stats = await self.dispatcher.refresh_decode_load()
            for i, s in enumerate(stats):
                if s is not None:
                    self.metrics.set_kv_usage(i, 1.0 - s.free_blocks / s.total_blocks)
        except Exception:  # noqa: BLE001 - load polling is best effort
            pass
        try:
            await self._heal_decode()
        except Exception as e:  # noqa: BLE001 - tried again at the next poll
            log.warning("decode health check failed: %s", e)

    async def set_prefill_check(self, seconds: float) -> float:
        """How often the prefill pool is probed for workers that died idle (0: never; a chunk
        still finds a dead member, and a request it fails runs again). Returns the old period."""
        old, self.prefill_check_s = self.prefill_check_s, check_period(seconds)
        return old

    def _prefill_period(self, busy: bool) -> float:
        """``prefill_check_s`` while busy; while idle doubled per probe, up to
        ``IDLE_PREFILL_CHECK_S`` (never below ``prefill_check_s``)."""
        if busy:
            self._prefill_backoff = 1
        cap = max(self.prefill_check_s, IDLE_PREFILL_CHECK_S)
        return min(cap, self.prefill_check_s * self._prefill_backoff)

    def _heal_prefill(self, busy: bool = True) -> None:
        """Every ``prefill_check_s`` (backed off while idle), have the pool replace workers
        that died idle, in a task (replacing waits for running chunks to finish; load polling
        goes on meanwhile)."""
        loop = asyncio.get_running_loop()
        if (not self.prefill_check_s or self._prefill_healing is not None
                or loop.time() - self._last_prefill_check < self._prefill_period(busy)):
            return
        self._last_prefill_check = loop.time()
        if not busy and self.prefill_check_s * self._prefill_backoff < IDLE_PREFILL_CHECK_S:
            self._prefill_backoff *= 2

        async def heal() -> None:
            try:
                replaced = await self._prefill_h.heal.remote()
                if replaced:
                    log.error("prefill workers %s had died idle: replaced", replaced)
            except Exception as e:  # noqa: BLE001 - tried again at the next check
                log.warning("prefill health check failed: %s", e)
            finally:
                self._prefill_healing = None

        self._prefill_healing = loop.create_task(heal())

    async def _heal_decode(self) -> None:
        """Take broken decode instances out of routing and restart each in a task of its own
        (load polling goes on meanwhile)."""
        for i, err in enumerate(await self._decode_h.health.remote()):
            if err is None or i in self._healing:
                continue
            if i not in self.dispatcher.control.router.down:
                log.error("decode instance %d broke (%s): routing around it and restarting", i, err)
                self.dispatcher.set_decode_up(i, False)
            task = asyncio.get_running_loop().create_task(self._restart_decode(i))
            self._healing[i] = task
            task.add_done_callback(lambda _t, i=i: self._healing.pop(i, None))

    async def _restart_decode(self, i: int) -> None:
        """Restart decode instance ``i`` connected to the prefill workers as they are now (the
        pool may have replaced some since), give them its new transfer agents and route to it
        again; a failed try waits 1, 2, 4, ... up to 60 s before the next."""
        wait, peers = 1.0, None
        while True:
            try:
                if peers is None:
                    senders = await self._prefill_h.peers.remote()
                    peers = await self._decode_h.recover.remote(i, actor_handles(senders))
                await self._prefill_h.connect_receivers.remote(peers)
                break
            except Exception as e:  # noqa: BLE001 - stays down; tried again
                if peers is not None and (await self._decode_h.health.remote())[i] is not None:
                    peers = None   # it broke again: restart it again; else only reconnect
                log.error("decode instance %d: restart failed (%s); next try in %.0f s", i, e, wait)
                await asyncio.sleep(wait)
                wait = min(60.0, 2 * wait)
        self.dispatcher.set_decode_up(i, True)
        self.restarts[i] = self.restarts.get(i, 0) + 1
        self.metrics.count_decode_restart(i)
        log.warning("decode instance %d restarted; routing to it again", i)
