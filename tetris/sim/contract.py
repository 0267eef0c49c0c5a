"""The scheduler-contract pieces the simulator uses beyond policies, built for a cluster.

All of them are the scheduler's own classes (the code the live dispatcher runs): decode
latency, Llumnix-style decode router, improvement-rate table and rate monitor.
"""

from __future__ import annotations

from pathlib import Path

from tetris.scheduler.decode_latency import DecodeLatencyModel
from tetris.scheduler.rate import ImprovementRateTable, RateMonitor
from tetris.scheduler.router import DecodeRouter

__all__ = ["decode_step_fn", "make_router", "load_rate_table", "make_rate_monitor",
           "write_rate_table"]


def decode_step_fn(cluster):
    return DecodeLatencyModel.for_model(cluster.model).step_time


def make_router(capacities: list[int]) -> DecodeRouter:
    return DecodeRouter(capacities)


def load_rate_table(path: str | Path) -> ImprovementRateTable:
    return ImprovementRateTable.load(path)


def write_rate_table(path: str | Path, rates: list[float], thetas: list[float], note: str) -> Path:
    return ImprovementRateTable(rates, thetas, description=note).save(path)


def make_rate_monitor(window_s: float, update_interval_s: float,
                      table: ImprovementRateTable, min_arrivals: int = 0) -> RateMonitor:
    # The simulated clock starts at 0: the rate's span counts from there, not the first arrival.
    return RateMonitor(window_s, update_interval_s, table, start_time=0.0,
                       min_arrivals=min_arrivals)
