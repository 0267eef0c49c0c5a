"""The dispatcher's operator surface: θ tables, the latency profile, drains, decode
instances up or down, load and what is still held. The admin routes and the supervisor
call these; requests never do."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from tetris.scheduler.latency import PrefillLatencyModel, PrefillProfile
from tetris.scheduler.layout_policy import with_layout_choice
from tetris.scheduler.policies import policy_from_config
from tetris.scheduler.rate import ImprovementRateTable, RateMonitor

__all__ = ["DispatcherAdmin", "rate_table_path"]


class DispatcherAdmin:
    """Mixed into ``Dispatcher``: builds, reads and replaces what its control plane plans
    with."""

    def _make_policy(self, profile: PrefillLatencyModel):
        return with_layout_choice(policy_from_config(self.deployment.scheduler, profile=profile),
                                  self.deployment)

    def _make_monitor(self, table: ImprovementRateTable | None) -> RateMonitor | None:
        sc = self.deployment.scheduler
        if table is None and sc.rate_table:
            table = ImprovementRateTable.load(rate_table_path(sc.rate_table))
        if table is None:
            return None   # θ stays at scheduler.improvement_rate
        return RateMonitor(sc.rate_window_s, sc.rate_update_interval_s, table,
                           min_arrivals=sc.rate_min_arrivals)

    def rate_table(self) -> dict:
        monitor = self.control.monitor
        if monitor is None:
            return {"rates": [], "improvement_rates": [], "description": "no table: fixed θ",
                    "improvement_rate": self.improvement_rate}
        t = monitor.table
        return {"rates": list(t.rates), "improvement_rates": list(t.improvement_rates),
                "description": t.description, "improvement_rate": self.improvement_rate}

    def set_rate_table(self, rates: list[float], improvement_rates: list[float],
                       description: str = "") -> dict:
        """Replace the θ table (admin route); raises ``RateTableError`` for a bad table."""
        table = ImprovementRateTable(rates, improvement_rates, description=description)
        if self.control.monitor is None:
            self.control.monitor = self._make_monitor(table)
        else:
            self.control.monitor.replace_table(table)
        return self.rate_table()

    def latency_profile(self) -> dict:
        return msgspec.to_builtins(self.profile.to_profile())

    def set_latency_profile(self, body: dict) -> dict:
        """Replace the prefill latency profile (admin route); the policy is rebuilt on it."""
        model = PrefillLatencyModel.from_profile(msgspec.convert(body, PrefillProfile))
        self.control.policy = self._make_policy(model)
        self.profile = model
        return self.latency_profile()

    def drain(self, instances: Sequence[int], seconds: float) -> dict:
        """Keep new plans off ``instances`` for ``seconds`` (admin route); running work goes on."""
        if not 0 < seconds <= 3600:
            raise ValueError(f"seconds must be in (0, 3600], got {seconds}")
        self.control.queue.hold([int(i) for i in instances], self.clock() + seconds)
        return self.stats()

    def set_decode_up(self, instance: int, up: bool) -> None:
        """Route new requests to decode ``instance`` again, or stop (it broke and is being
        restarted); requests already there end as the instance lets them."""
        self.control.set_decode_up(int(instance), bool(up))
        if not up and getattr(self, "decode_kept", None) is not None:
            self.decode_kept.lost(int(instance))   # restarted: its kept KV is gone
        if self.metrics is not None:
            self.metrics.set_decode_up(int(instance), bool(up))

    # -- load and leaks ---------------------------------------------------------------------
    async def refresh_decode_load(self) -> list[Any]:
        """Pull the decode instances' load into the router (free slots, batch size)."""
        stats = await self.decode.stats()
        for i, s in enumerate(stats):
            if s is not None:
                self.control.decode_report(i, s.free_blocks * s.block_size, s.running)
        return stats

    def stats(self) -> dict:
        now = self.clock()
        return {"running": len(self._inflight), "waiting": 0,
                "improvement_rate": self.improvement_rate,
                "decode_down": sorted(self.control.router.down),
                "queue_times": [max(0.0, t - now) for t in self.control.queue.queue_times(now)]}

    async def prefix_cache(self, clear: bool = False) -> dict:
        """The prefix index's state; ``clear`` drops its unreferenced blocks first and frees
        the runs let go on the prefill pool (``tetris.serve.prefix_cache``)."""
        from tetris.serve import prefix_cache

        if clear:
            return await prefix_cache.clear(self.control, self.prefill, self.decode,
                                            self.decode_kept)
        return prefix_cache.view(self.control, self.decode_kept)

    def held(self) -> dict:
        """What is still reserved on the control side (zero everywhere when idle)."""
        return {"inflight": len(self._inflight), **self.control.held(),
                "cleanups": len(self._cleanups), "relayed": len(self._relay)}


def rate_table_path(name: str) -> str:
    from pathlib import Path
    from importlib import resources

    p = Path(name)
    if p.exists():
        return str(p)
    embedded = Path(str(resources.files("tetris.configs").joinpath("rates", name)))
    return str(embedded if embedded.exists() else p)
