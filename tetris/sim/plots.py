"""PNG figures of the simulator (matplotlib, Agg backend): the pool schedule and paper Figs 8-13."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tetris.sim.prefill import ChunkRun  # noqa: E402

__all__ = ["plot_schedule", "plot_ttft_vs_rate", "plot_cdf", "plot_ratio_vs_rate", "save_figure"]

_DPI = 80


def save_figure(fig, path: str | Path, dpi: int = _DPI) -> Path:
    """Write ``fig`` as a PNG at ``path`` (its folder made if missing) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_schedule(runs: Sequence[ChunkRun], num_instances: int, path: str | Path,
                  t0: float | None = None, t1: float | None = None, title: str = "") -> Path:
    """Instances by time; a colour per request, hatched after the first chunk of a request."""
    t0 = min(r.start for r in runs) if t0 is None else t0
    t1 = max(r.end for r in runs) if t1 is None else t1
    cmap = plt.get_cmap("tab20")
    ids = sorted({r.request_id for r in runs}, key=lambda s: (len(s), s))
    colour = {rid: cmap(k % 20) for k, rid in enumerate(ids)}
    fig, ax = plt.subplots(figsize=(10, 0.25 * num_instances + 1.2))
    for r in runs:
        if r.end < t0 or r.start > t1:
            continue
        for i in r.instances:
            ax.broken_barh([(r.start, r.end - r.start)], (i - 0.4, 0.8), facecolors=colour[r.request_id],
                           edgecolor="black", linewidth=0.3, hatch="//" if r.index else None)
    ax.set_xlim(t0, t1)
    ax.set_ylim(-0.6, num_instances - 0.4)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("prefill instance")
    ax.set_title(title or "prefill pool schedule (colour = request, hatched = later chunk)")
    return save_figure(fig, path)


def plot_ttft_vs_rate(rows: list[dict], path: str | Path, threshold: tuple[float, float] | None = None,
                      title: str = "") -> Path:
    """Paper Fig. 8: TTFT P50 and P99 against arrival rate, one line per policy."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, (key, ax) in enumerate(zip(("ttft_p50", "ttft_p99"), axes)):
        for policy in sorted({r["policy"] for r in rows}):
            pts = sorted((r["rate"], r[key]) for r in rows if r["policy"] == policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=policy)
        if threshold is not None:
            ax.axhline(25 * threshold[k], color="grey", ls="--", lw=1, label="25x light load")
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"TTFT {key[-3:].upper()} (s)")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_cdf(ttfts: dict[str, Sequence[float]], path: str | Path, title: str = "") -> Path:
    """Paper Fig. 9: TTFT CDF per policy at one rate."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for policy in sorted(ttfts):
        x = np.sort(np.asarray(ttfts[policy]))
        ax.plot(x, np.arange(1, x.size + 1) / x.size, label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=7)
    ax.set_title(title)
    return save_figure(fig, path)


def plot_ratio_vs_rate(series: dict[str, list[tuple[float, float]]], path: str | Path,
                       ylabel: str, title: str = "") -> Path:
    """Paper Figs. 11-13: a ratio (e.g. TTFT at fixed θ / TTFT at dynamic θ) against rate."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name in series:
        pts = sorted(series[name])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.set_title(title)
    return save_figure(fig, path)
