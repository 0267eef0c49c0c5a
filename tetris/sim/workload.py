"""Workloads: the paper's Short/Medium/Long length distributions, Poisson arrivals, trace files.

The production traces of the paper are not public; only their prompt-length ranges and means
are (SPEC §8). We sample prompt lengths from a **truncated log-normal** on ``[min, max]`` whose
shape ``sigma`` is fixed and whose location is solved so that the truncated mean equals the
paper's mean: long-context traffic is right-skewed (many prompts near the low end, a tail of
very long ones), which a log-normal expresses with one shape parameter. Output lengths are not
given by the paper; we use a truncated log-normal on ``[32, 2048]`` with mean 384 tokens
(long-document QA/summarisation answers), the same for every trace.

Arrivals are a seeded Poisson process. A run at rate ``r`` uses unit-rate gaps divided by ``r``
(the same random numbers at every rate), which is the paper's way of varying load: scaling the
arrival timestamps of one trace.

Trace files (CSV with a header, or JSONL, one object per line) hold the fields
``arrival_time`` (seconds, non-decreasing), ``prompt_tokens`` and ``output_tokens``.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import msgspec
import numpy as np

__all__ = [
    "SimRequest",
    "LengthDistribution",
    "WORKLOADS",
    "OUTPUT_LENGTHS",
    "output_lengths",
    "poisson_workload",
    "load_trace",
    "save_trace",
    "scale_to_rate",
    "workload_by_name",
]


class SimRequest(msgspec.Struct, frozen=True):
    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    # Chained hashes of the prompt's whole blocks (prefix caching; a Mooncake trace's
    # ``hash_ids``); empty: the prompt shares nothing (``tetris.sim.prefix_workload``).
    block_hashes: tuple[int, ...] = ()


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


class LengthDistribution(msgspec.Struct, frozen=True):
    """Truncated log-normal on ``[min_tokens, max_tokens]`` with the given mean."""

    name: str
    min_tokens: int
    max_tokens: int
    mean_tokens: float
    sigma: float = 0.8

    def __post_init__(self) -> None:
        if not 0 < self.min_tokens < self.mean_tokens < self.max_tokens:
            raise ValueError(f"{self.name}: need 0 < min < mean < max")
        if self.sigma <= 0:
            raise ValueError(f"{self.name}: sigma must be positive")

    def truncated_mean(self, mu: float) -> float:
        # E[X | a <= ln X <= b] for ln X ~ N(mu, sigma^2): the standard truncated-lognormal mean.
        s, a, b = self.sigma, math.log(self.min_tokens), math.log(self.max_tokens)
        den = _phi((b - mu) / s) - _phi((a - mu) / s)
        num = _phi((b - mu - s * s) / s) - _phi((a - mu - s * s) / s)
        if den <= 0:
            return self.min_tokens if mu < a else self.max_tokens
        return math.exp(mu + s * s / 2) * num / den

    def location(self) -> float:
        """``mu`` such that the truncated mean is ``mean_tokens`` (bisection; the mean is monotone in mu)."""
        lo, hi = math.log(self.min_tokens) - 5 * self.sigma, math.log(self.max_tokens) + 5 * self.sigma
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if self.truncated_mean(mid) < self.mean_tokens:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integer lengths, by rejection from the untruncated log-normal."""
        mu = self.location()
        out = np.empty(0, dtype=np.int64)
        while out.size < n:
            x = rng.lognormal(mu, self.sigma, size=2 * (n - out.size) + 16)
            x = x[(x >= self.min_tokens) & (x <= self.max_tokens)]
            out = np.concatenate([out, np.rint(x).astype(np.int64)])
        return out[:n]


# SPEC §8 / paper §7.1: ranges and means of the three production traces.
WORKLOADS: dict[str, LengthDistribution] = {
    "short": LengthDistribution("short", 4_000, 95_000, 23_600),
    "medium": LengthDistribution("medium", 8_000, 142_000, 32_800),
    "long": LengthDistribution("long", 16_000, 190_000, 50_100),
}
OUTPUT_LENGTHS = LengthDistribution("output", 32, 2048, 384, sigma=1.0)


def output_lengths(mean_tokens: float = OUTPUT_LENGTHS.mean_tokens) -> LengthDistribution:
    """Output lengths with the given mean: ``OUTPUT_LENGTHS`` with its maximum scaled by the same
    factor as the mean (the minimum, 32, and σ stay), so the shape is kept; 384 gives the default."""
    if mean_tokens == OUTPUT_LENGTHS.mean_tokens:
        return OUTPUT_LENGTHS
    hi = max(OUTPUT_LENGTHS.max_tokens,
             round(OUTPUT_LENGTHS.max_tokens * mean_tokens / OUTPUT_LENGTHS.mean_tokens))
    return msgspec.structs.replace(OUTPUT_LENGTHS, mean_tokens=float(mean_tokens), max_tokens=hi)


def poisson_workload(dist: LengthDistribution, rate: float, n: int, seed: int,
                     outputs: LengthDistribution = OUTPUT_LENGTHS) -> list[SimRequest]:
    """``n`` requests with Poisson arrivals at ``rate`` req/s; same seed, same requests at any rate."""
    if rate <= 0 or n <= 0:
        raise ValueError(f"rate and request count must be positive, got {rate}, {n}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, size=n)
    prompts = dist.sample(rng, n)
    outs = outputs.sample(rng, n)
    arrivals = np.cumsum(gaps) / rate
    return [SimRequest(f"r{i}", float(arrivals[i]), int(prompts[i]), int(outs[i])) for i in range(n)]


def scale_to_rate(requests: list[SimRequest], rate: float) -> list[SimRequest]:
    """Scale arrival timestamps so that the trace's mean rate is ``rate`` (paper §7.2)."""
    if not requests:
        return []
    t0 = requests[0].arrival_time
    span = requests[-1].arrival_time - t0
    if span <= 0 or rate <= 0:
        raise ValueError("need at least two distinct arrival times and a positive rate")
    factor = (len(requests) - 1) / rate / span
    return [msgspec.structs.replace(r, arrival_time=(r.arrival_time - t0) * factor) for r in requests]


def _row(i: int, obj: dict, where: str) -> SimRequest:
    try:
        t, p, o = float(obj["arrival_time"]), int(obj["prompt_tokens"]), int(obj["output_tokens"])
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: row {i} needs numeric arrival_time, prompt_tokens, "
                         f"output_tokens ({e})") from None
    if p <= 0 or o <= 0 or t < 0:
        raise ValueError(f"{where}: row {i} has a non-positive length or negative time")
    return SimRequest(str(obj.get("request_id", f"r{i}")), t, p, o)


def load_trace(path: str | Path) -> list[SimRequest]:
    """Read a CSV (with header) or JSONL trace; rows are sorted by arrival time (stable)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {path} does not exist")
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    reqs = [_row(i, r, str(path)) for i, r in enumerate(rows)]
    if not reqs:
        raise ValueError(f"trace file {path} holds no requests")
    return sorted(reqs, key=lambda r: r.arrival_time)


def save_trace(requests: list[SimRequest], path: str | Path) -> None:
    path = Path(path)
    fields = ("request_id", "arrival_time", "prompt_tokens", "output_tokens")
    if path.suffix in (".jsonl", ".json"):
        path.write_text("".join(json.dumps({k: getattr(r, k) for k in fields}) + "\n" for r in requests))
    else:
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(fields)
            for r in requests:
                w.writerow([getattr(r, k) for k in fields])


def workload_by_name(name: str) -> LengthDistribution:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)} or a trace file") from None
