"""The prefill pool's KV streaming wiring: the send side's config and the receivers' table.

Both are kept so that a worker that replaces a dead one gets the send side and the receivers as
they are then (``prepare``), and every receiver learns each change of senders: a dead worker
at once (``forget``: it gives up the shards that worker owed it), its replacement before any
chunk runs on it (``restore``). ``PrefillPool.enable_transfer`` / ``connect_receivers`` fill
the wiring in; the world keeper (``worlds.WorldKeeper``) calls the rest while it replaces
workers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import ray

from tetris.config import TransferConfig
from tetris.transfer.messages import AgentInfo

__all__ = ["TransferWiring"]

log = logging.getLogger(__name__)


class TransferWiring:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.config: TransferConfig | None = None   # once ``enable`` ran
        self.receivers: dict = {}     # receiver id -> (actor handle, AgentInfo)

    def enable(self, workers: Sequence, config: TransferConfig) -> dict[int, AgentInfo]:
        """Start every worker's send side; instance -> its agent's info."""
        infos = ray.get([w.enable_transfer.remote(config) for w in workers],
                        timeout=max(120.0, self.timeout_s))
        self.config = config
        return dict(enumerate(infos))

    def prepare(self, new: dict) -> None:
        """Workers not yet in the pool (``new``: instance -> actor) get the send side and the
        receivers as they are now (no-op before ``enable``)."""
        if self.config is not None and new:
            ray.get([w.enable_transfer.remote(self.config) for w in new.values()],
                    timeout=max(120.0, self.timeout_s))
            self._connect_new(new)

    def forget(self, instances: Iterable[int]) -> None:
        """Every receiver learns that the workers of ``instances`` are dead (no peer under
        those ids until their replacements are in) and gives up what they owed it."""
        instances = list(instances)
        if instances and self.config is not None and self.receivers:
            self.tell_receivers(self.receivers, dict.fromkeys(instances))

    def restore(self, new: dict) -> None:
        """The replaced workers' new actors (``new``: instance -> actor) are connected to the
        receivers as they are now (some may have restarted since the workers started) and
        every receiver is told them, so that its grants reach them and not the dead ones, and
        it gives up what the dead ones owed it."""
        if self.config is None or not new:
            return
        if self.receivers:
            self._connect_new(new)
            self.tell_receivers(self.receivers, new)

    def _connect_new(self, new: dict) -> None:
        """Connect workers not yet in the pool to the receivers as they are now."""
        table = dict(self.receivers)
        if table:
            ray.get([w.connect_receivers.remote(table) for w in new.values()],
                    timeout=max(120.0, self.timeout_s))

    def tell_receivers(self, receivers: dict, senders: dict) -> None:
        """Each receiver (id -> (actor, info)) learns ``senders`` (instance -> worker actor, or
        None: the worker is dead and not yet replaced).
        A receiver that is gone is being restarted by its owner, who connects the workers to
        its successor (``connect_receivers``, which tells it the workers as they are then)."""
        for rid, ref in [(rid, h.connect_senders.remote(senders))
                         for rid, (h, _info) in sorted(receivers.items())]:
            try:
                ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                log.warning("receiver %d did not take the senders: %s", rid, e)
