"""Per-request records of a load test and their summary (P50/P90/P99, SLO attainment).

Pure Python: the locustfile fills a ``LoadReport`` from streamed responses; tests and the
fidelity benchmark read it without Locust.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["RequestRecord", "LoadReport", "percentile"]


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int
    sent_at: float
    ok: bool = False
    error: str = ""
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    token_gaps_s: list[float] = field(default_factory=list)

    @property
    def mean_itl_s(self) -> float:
        return sum(self.token_gaps_s) / len(self.token_gaps_s) if self.token_gaps_s else math.nan


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {
        "mean": (sum(values) / len(values)) if values else math.nan
    }


@dataclass
class LoadReport:
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    records: list[RequestRecord] = field(default_factory=list)

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)

    def summary(self, duration_s: float | None = None) -> dict:
        ok = [r for r in self.records if r.ok]
        gaps = [g for r in ok for g in r.token_gaps_s]
        out = {
            "requests": len(self.records),
            "succeeded": len(ok),
            "failed": len(self.records) - len(ok),
            "ttft_s": _stats([r.ttft_s for r in ok]),
            "itl_s": _stats(gaps),
            "e2e_s": _stats([r.e2e_s for r in ok]),
            "output_tokens": sum(r.output_tokens for r in ok),
        }
        if duration_s:
            out["duration_s"] = duration_s
            out["throughput_rps"] = len(ok) / duration_s
            out["output_tokens_per_s"] = out["output_tokens"] / duration_s
        if self.slo_ttft_s is not None or self.slo_itl_s is not None:
            out["slo_attainment"] = self._attainment(ok)
        return out

    def _attainment(self, ok: list[RequestRecord]) -> float:
        """Share of all sent requests that succeeded within every SLO given."""
        if not self.records:
            return math.nan
        good = 0
        for r in ok:
            if self.slo_ttft_s is not None and not r.ttft_s <= self.slo_ttft_s:
                continue
            if self.slo_itl_s is not None and r.token_gaps_s and not r.mean_itl_s <= self.slo_itl_s:
                continue
            good += 1
        return good / len(self.records)

    def write(self, prefix: str | Path, duration_s: float | None = None) -> dict:
        """Write ``PREFIX_requests.csv`` and ``PREFIX_summary.json``; return the summary."""
        prefix = Path(prefix)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        summary = self.summary(duration_s)
        cols = ["request_id", "prompt_tokens", "sent_at", "ok", "error", "ttft_s", "e2e_s",
                "output_tokens", "mean_itl_s"]
        with open(f"{prefix}_requests.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            for r in self.records:
                row = {k: v for k, v in asdict(r).items() if k in cols}
                w.writerow(row | {"mean_itl_s": r.mean_itl_s})
        Path(f"{prefix}_summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True))
        return summary
