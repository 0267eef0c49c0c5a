"""Load-aware improvement rate θ (SPEC §4): the offline table and the online monitor.

The table maps a profiled arrival rate (req/s) to the θ that gave the lowest TTFT there; the
simulator helper's profiler fills it, files live under ``configs/rates/``. The monitor counts
arrivals over a sliding window and, every ``update_interval_s``, looks up the nearest profiled
rate. Both are pure: the caller passes the time in (simulated or wall clock).
"""

from __future__ import annotations

import bisect
import json
import tomllib
from collections import deque
from pathlib import Path

import msgspec

__all__ = ["ImprovementRateTable", "RateMonitor", "RateTableError"]


class RateTableError(ValueError):
    """An improvement-rate table is missing, malformed or empty."""


class _TableFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rates: list[float]
    improvement_rates: list[float]
    description: str = ""


class ImprovementRateTable:
    """Profiled arrival rates (req/s, ascending) and the best θ at each.

    File format (TOML, or JSON with the same keys)::

        # free-text comment lines
        description = "how the table was made"     # optional
        rates = [0.5, 1.0, 1.5]
        improvement_rates = [0.15, 0.25, 0.35]
    """

    def __init__(self, rates: list[float], improvement_rates: list[float], *,
                 description: str = ""):
        if not rates or len(rates) != len(improvement_rates):
            raise RateTableError(
                f"a rate table needs matching, non-empty lists; got {len(rates)} rates and "
                f"{len(improvement_rates)} improvement rates"
            )
        pairs = sorted(zip((float(r) for r in rates), (float(t) for t in improvement_rates)))
        for r, t in pairs:
            if r < 0 or not 0.0 <= t < 1.0:
                raise RateTableError(f"bad entry rate={r}, θ={t} (need rate >= 0, θ in [0, 1))")
        if len({r for r, _ in pairs}) != len(pairs):
            raise RateTableError("duplicate rates in the table")
        self.rates = [r for r, _ in pairs]
        self.improvement_rates = [t for _, t in pairs]
        self.description = description

    def lookup(self, rate: float) -> float:
        """θ of the profiled rate nearest to ``rate`` (paper §7.1); ties go to the lower rate."""
        k = bisect.bisect_left(self.rates, rate)
        if k == 0:
            return self.improvement_rates[0]
        if k == len(self.rates):
            return self.improvement_rates[-1]
        lo, hi = self.rates[k - 1], self.rates[k]
        return self.improvement_rates[k - 1 if rate - lo <= hi - rate else k]

    def save(self, path: str | Path) -> Path:
        """Write TOML (``.toml``) or JSON (any other suffix)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix == ".toml":
            body = [f"# {line}" for line in self.description.splitlines()]
            body += [f"description = {json.dumps(self.description)}",
                     f"rates = {json.dumps(self.rates)}",
                     f"improvement_rates = {json.dumps(self.improvement_rates)}"]
            p.write_text("\n".join(body) + "\n")
        else:
            f = _TableFile(self.rates, self.improvement_rates, self.description)
            p.write_bytes(msgspec.json.format(msgspec.json.encode(f), indent=2) + b"\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> "ImprovementRateTable":
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise RateTableError(f"{p}: {e.strerror}") from None
        try:
            data = tomllib.loads(raw.decode()) if p.suffix == ".toml" else json.loads(raw)
            f = msgspec.convert(data, _TableFile)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, msgspec.ValidationError) as e:
            raise RateTableError(f"{p}: {e}") from None
        return cls(f.rates, f.improvement_rates, description=f.description)


class RateMonitor:
    """Sliding-window arrival rate and the θ it selects, updated every ``update_interval_s``.

    The rate is arrivals in ``(t − window_s, t]`` over ``min(window_s, t − start_time)``.
    ``min_arrivals`` (0: off) stretches a full window back to the ``min_arrivals``-th most
    recent arrival when ``window_s`` holds fewer: a Poisson count of ``n`` has relative error
    ``1/sqrt(n)``, so at 0.5 req/s (LLaMA3-70B's load) a 60 s window (30 arrivals, ±18%)
    lands on the wrong row of a table stepped by 0.125 req/s about half the time.
    Warm-up: before one update interval has passed since ``start_time``, θ follows the
    elapsed-time rate at every call once ``warmup_arrivals`` arrivals have been seen (a rate
    from one arrival over 0.1 s reads as 10 req/s and used to be kept for a whole interval;
    holding the light-load θ for the first interval instead lets an overloaded pool build a
    backlog it never drains). Until then θ is ``initial_improvement_rate`` (default: the
    table's lightest-load entry). After warm-up, an update every ``update_interval_s`` (paper
    §7.1: 30 s). ``start_time`` None means the clock of the first call (a live dispatcher on a
    wall clock); a simulation passes its own start.
    """

    def __init__(self, window_s: float, update_interval_s: float, table: ImprovementRateTable,
                 initial_improvement_rate: float | None = None,
                 start_time: float | None = None, warmup_arrivals: int = 8,
                 min_arrivals: int = 0):
        if window_s <= 0 or update_interval_s <= 0:
            raise RateTableError("window_s and update_interval_s must be positive")
        if update_interval_s > window_s:
            # Arrivals between two updates would fall out of the window unseen.
            raise RateTableError(
                f"update_interval_s {update_interval_s} exceeds window_s {window_s}")
        if min_arrivals < 0:
            raise RateTableError(f"min_arrivals must be >= 0, got {min_arrivals}")
        self.window_s = window_s
        self.min_arrivals = min_arrivals
        self.update_interval_s = update_interval_s
        self.table = table
        self._arrivals: deque[float] = deque()
        self._last_update: float | None = None
        self.start_time = start_time
        self.warmup_arrivals = max(1, warmup_arrivals)
        self._seen = 0
        self.improvement_rate = (table.improvement_rates[0] if initial_improvement_rate is None
                                 else initial_improvement_rate)

    def _start(self, t: float) -> float:
        if self.start_time is None:
            self.start_time = t
        return self.start_time

    def observe_arrival(self, t: float) -> None:
        self._start(t)
        if self._arrivals and t < self._arrivals[-1]:
            raise RateTableError(f"arrival at {t} is earlier than the last one {self._arrivals[-1]}")
        self._arrivals.append(t)
        self._seen += 1

    def current_rate(self, t: float) -> float:
        """Arrivals per second over the last ``min(window_s, t − start_time)`` seconds, the
        window stretched to hold ``min_arrivals`` arrivals where it holds fewer."""
        start = self._start(t)
        arrivals = self._arrivals
        cutoff = t - self.window_s
        # Keep the min_arrivals most recent arrivals even when they are older than the window.
        while arrivals and arrivals[0] <= cutoff and len(arrivals) > self.min_arrivals:
            arrivals.popleft()
        seen = [a for a in arrivals if a <= t]
        span = self.window_s
        inside = sum(1 for a in seen if a > cutoff)
        if inside < self.min_arrivals and len(seen) > inside and t - start > self.window_s:
            # The window reaches back to the oldest kept arrival and counts those after it:
            # (n − 1) gaps over their Gamma(n, rate) span is an unbiased rate.
            span = t - seen[0]
            inside = len(seen) - 1
        span = min(span, t - start)
        if span <= 0:
            return 0.0
        return inside / span

    def maybe_update(self, t: float) -> float | None:
        """The new θ if an update is due at ``t``, else None.

        Due: during warm-up (less than ``update_interval_s`` since the start) at every call
        once ``warmup_arrivals`` arrivals were seen; then every ``update_interval_s`` after the
        last update.
        """
        start = self._start(t)
        if t - start < self.update_interval_s:
            if self._seen < self.warmup_arrivals or t <= start:
                return None
        elif self._last_update is not None and self._last_update - start >= \
                self.update_interval_s and t - self._last_update < self.update_interval_s:
            return None
        self._last_update = t
        self.improvement_rate = self.table.lookup(self.current_rate(t))
        return self.improvement_rate

    def replace_table(self, table: ImprovementRateTable) -> None:
        """The API call of SPEC §4: a new length distribution brings a new table."""
        self.table = table
