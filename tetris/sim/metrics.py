"""Metrics of a simulated run: TTFT, TBT, percentiles, throughput, utilisation."""

from __future__ import annotations

import msgspec
import numpy as np

__all__ = ["LatencySummary", "SimResult", "summarise", "weighted_percentiles"]


class LatencySummary(msgspec.Struct, frozen=True):
    mean: float
    p50: float
    p90: float
    p99: float


def summarise(values: np.ndarray) -> LatencySummary:
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    if v.size == 0:
        nan = float("nan")
        return LatencySummary(nan, nan, nan, nan)
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return LatencySummary(float(v.mean()), float(p50), float(p90), float(p99))


def weighted_percentiles(values: np.ndarray, weights: np.ndarray, qs: list[float]) -> list[float]:
    """Percentiles of ``values`` where value ``i`` occurs ``weights[i]`` times (inverted CDF)."""
    v, w = np.asarray(values, dtype=float), np.asarray(weights, dtype=float)
    if v.size == 0 or w.sum() <= 0:
        return [float("nan")] * len(qs)
    order = np.argsort(v, kind="stable")
    v, cw = v[order], np.cumsum(w[order])
    return [float(v[min(np.searchsorted(cw, q / 100.0 * cw[-1], side="left"), v.size - 1)])
            for q in qs]


class SimResult(msgspec.Struct):
    """Everything one run measured; ``ttft_s`` etc. are per request in arrival order."""

    policy: str
    workload: str
    model: str
    rate: float
    requests: int
    seed: int
    ttft: LatencySummary
    tbt: LatencySummary | None
    throughput_rps: float            # completed requests / (last completion - first arrival)
    prefill_tokens_per_s: float      # prompt tokens / (last prefill end - first arrival)
    prefill_utilisation: float
    decode_utilisation: float | None
    mean_chunks: float
    mean_sp: float                   # token-weighted SP size of the chunks
    max_plan_deviation_s: float
    sim_wall_s: float
    sim_requests_per_s: float
    improvement_rates: list[float] = []   # θ values the run used, in order of change
    ttft_s: list[float] = []
    # Requests refused at arrival: larger than a decode instance's whole KV (the live system's
    # 429 DecodeFull). They have no TTFT (NaN in ttft_s) and count in no throughput or mean.
    refused: int = 0

    def brief(self) -> dict:
        d = msgspec.to_builtins(self)
        d.pop("ttft_s", None)
        return d
