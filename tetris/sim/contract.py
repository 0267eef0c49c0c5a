"""The scheduler-contract pieces the simulator needs beyond policies: decode latency, decode
router, improvement-rate table and rate monitor.

They come from ``tetris.scheduler`` (the same code the live dispatcher runs). While a piece is
not there yet (the scheduler is built in parallel), a minimal stand-in with the contract's
signatures is used and ``MISSING`` names it, so every result can say which one it ran with.
"""

from __future__ import annotations

import bisect
import json
import tomllib
from collections import deque
from pathlib import Path

__all__ = ["DecodeLatencyModel", "DecodeRouter", "ImprovementRateTable", "RateMonitor", "MISSING",
           "decode_step_fn", "make_router", "load_rate_table", "make_rate_monitor", "write_rate_table"]

MISSING: list[str] = []


class _StandInDecodeLatency:
    """Memory-bound decode step: weights and KV read once per step over TP GPUs' HBM.

    A100: 2.0 TB/s at 80% efficiency; plus 25 µs per layer for the TP all-reduces (tp > 1).
    """

    def __init__(self, weight_bytes: float, kv_bytes_per_token: float, layers: int):
        self.w, self.kv, self.layers = weight_bytes, kv_bytes_per_token, layers

    def step_time(self, tp_size: int, batch_size: int, context_tokens_total: int) -> float:
        bw = tp_size * 2.0e12 * 0.8
        comm = 0.0 if tp_size == 1 else 2 * self.layers * 25e-6
        return 2e-3 + (self.w + self.kv * context_tokens_total) / bw + comm + 2e-5 * batch_size


try:
    from tetris.scheduler.decode_latency import DecodeLatencyModel
except ImportError:
    DecodeLatencyModel = None
    MISSING.append("tetris.scheduler.decode_latency")

try:
    from tetris.scheduler.router import DecodeRouter
except ImportError:
    DecodeRouter = None
    MISSING.append("tetris.scheduler.router")

try:
    from tetris.scheduler.rate import ImprovementRateTable, RateMonitor
except ImportError:
    ImprovementRateTable = RateMonitor = None
    MISSING.append("tetris.scheduler.rate")


def decode_step_fn(cluster):
    if DecodeLatencyModel is not None:
        return DecodeLatencyModel.for_model(cluster.model).step_time
    return _StandInDecodeLatency(cluster.params_billion * 2e9, cluster.kv_bytes_per_token,
                                 cluster.num_layers).step_time


class _StandInRouter:
    """Llumnix virtual usage: highest (free − virtual) / (batch + 1); lowest index on ties."""

    def __init__(self, capacities: list[int]):
        self.free = list(capacities)
        self.virtual = [0] * len(capacities)
        self.batch = [0] * len(capacities)

    def choose(self, kv_tokens: int) -> int:
        return max(range(len(self.free)),
                   key=lambda d: ((self.free[d] - self.virtual[d]) / (self.batch[d] + 1), -d))

    def reserve(self, d: int, kv_tokens: int) -> None:
        self.virtual[d] += kv_tokens

    def release(self, d: int, kv_tokens: int) -> None:
        self.virtual[d] -= kv_tokens

    def update(self, d: int, free_slots: int, batch_size: int) -> None:
        self.free[d], self.batch[d] = free_slots, batch_size


def make_router(capacities: list[int]):
    if DecodeRouter is not None:
        return DecodeRouter(capacities)
    return _StandInRouter(capacities)


class _StandInTable:
    def __init__(self, rates: list[float], improvement_rates: list[float]):
        if len(rates) != len(improvement_rates) or not rates:
            raise ValueError("a rate table needs matching, non-empty rates and θ lists")
        self.rates, self.improvement_rates = list(rates), list(improvement_rates)

    def lookup(self, rate: float) -> float:
        """θ of the nearest profiled rate (paper §7.1); ties go to the lower rate."""
        k = bisect.bisect_left(self.rates, rate)
        if k == 0:
            return self.improvement_rates[0]
        if k == len(self.rates):
            return self.improvement_rates[-1]
        lo, hi = self.rates[k - 1], self.rates[k]
        return self.improvement_rates[k - 1 if rate - lo <= hi - rate else k]


class _StandInMonitor:
    """Arrivals in a sliding window; θ refreshed at most every ``update_interval_s``."""

    def __init__(self, window_s: float, update_interval_s: float, table):
        self.window, self.interval, self.table = window_s, update_interval_s, table
        self.arrivals: deque[float] = deque()
        self.last_update = float("-inf")
        self.current = table.improvement_rates[0]

    def observe_arrival(self, t: float) -> None:
        self.arrivals.append(t)

    def current_rate(self, t: float) -> float:
        while self.arrivals and self.arrivals[0] < t - self.window:
            self.arrivals.popleft()
        return len(self.arrivals) / min(self.window, max(t, 1e-9))

    def maybe_update(self, t: float) -> float | None:
        if t - self.last_update < self.interval:
            return None
        self.last_update = t
        self.current = self.table.lookup(self.current_rate(t))
        return self.current


def load_rate_table(path: str | Path):
    if ImprovementRateTable is not None:
        return ImprovementRateTable.load(path)
    data = tomllib.loads(Path(path).read_text())
    return _StandInTable(data["rates"], data["improvement_rates"])


def write_rate_table(path: str | Path, rates: list[float], thetas: list[float], note: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if ImprovementRateTable is not None:
        ImprovementRateTable(rates=rates, improvement_rates=thetas, description=note).save(path)
        return path
    body = [f"# {note}", f"rates = {json.dumps(rates)}", f"improvement_rates = {json.dumps(thetas)}"]
    path.write_text("\n".join(body) + "\n")
    return path


def make_rate_monitor(window_s: float, update_interval_s: float, table):
    if RateMonitor is not None:
        return RateMonitor(window_s, update_interval_s, table)
    return _StandInMonitor(window_s, update_interval_s, table)
