"""Memory of a live app's actors for ``tetris bench soak``: RSS series by pid, growth, a plot.

Every sample lists the ALIVE actors of the Ray cluster and keeps those of the app: the pools'
prefill workers and decode ranks (by the actor ids in the pools' peer tables), the app's Serve
replicas (class ``ServeReplica:<app>:<deployment>``), and Serve's controller and proxy. RSS is
read with psutil by pid; an actor is keyed by its id, so a restart shows as a second pid.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["ActorMemory", "rss_growth", "pool_actor_labels", "plot_rss", "GROWTH_TAIL"]

GROWTH_TAIL = 3      # samples averaged at the end: one GC pause must not decide a verdict
_MIB = 2 ** 20


def rss_growth(samples: list[tuple[float, int]], warmup_s: float,
               tail: int = GROWTH_TAIL) -> float | None:
    """Relative growth after warm-up of ``(t, rss)`` samples; None without two samples past it."""
    after = [rss for t, rss in samples if t >= warmup_s]
    if len(after) < 2:
        return None
    end = after[1:][-tail:]
    return float(np.mean(end)) / after[0] - 1.0


def _alive_actors() -> dict[str, tuple[str, int]]:
    """actor id (hex) -> (class name, pid) of every ALIVE actor.

    ``ray.util.state.list_actors`` goes through the dashboard, which the benchmark does not start
    (and which finds several clusters on a shared machine); the GCS table needs neither.
    """
    try:
        from ray._private.state import actors
    except ImportError:  # pragma: no cover - a Ray without the private table
        from ray.util.state import list_actors

        return {a.actor_id: (a.class_name, a.pid)
                for a in list_actors(filters=[("state", "=", "ALIVE")], limit=100_000)}
    return {aid: (a["ActorClassName"], a["Pid"]) for aid, a in sorted(actors().items())
            if a["State"] == "ALIVE"}


class ActorMemory:
    """RSS series of the app's actors: named pool actors plus Serve's replicas of the app and
    its controller and proxy, found again at every sample (a restarted actor shows a new pid)."""

    SERVE_SYSTEM = ("ServeController", "ProxyActor")

    def __init__(self, app_name: str, named: dict[str, str]) -> None:
        self.prefix = f"ServeReplica:{app_name}:"
        self.named = dict(named)                       # actor id -> label
        self.series: dict[str, list[tuple[float, int, int]]] = {}   # id -> (t, pid, rss)
        self.classes: dict[str, str] = {}
        self.labels: dict[str, str] = {}
        self.times: list[float] = []

    def _label(self, aid: str, cls: str) -> str | None:
        if aid in self.named:
            return self.named[aid]
        if cls.startswith(self.prefix):
            return cls[len(self.prefix):]
        return cls if cls in self.SERVE_SYSTEM else None

    def sample(self, t: float) -> None:
        import psutil

        for aid, (cls, pid) in _alive_actors().items():
            label = self._label(aid, cls)
            if label is None or not pid:
                continue
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:   # gone between the table and the read: counted as lost later
                continue
            self.series.setdefault(aid, []).append((t, pid, rss))
            self.classes[aid], self.labels[aid] = cls, label
        self.times.append(t)

    def report(self, warmup_s: float) -> list[dict]:
        last = self.times[-1] if self.times else 0.0
        rows = []
        for aid in sorted(self.series, key=lambda a: (self.labels[a], a)):
            s = self.series[aid]
            after = [rss for t, _pid, rss in s if t >= warmup_s]
            rows.append({
                "label": self.labels[aid], "class_name": self.classes[aid], "pid": s[-1][1],
                "samples": len(s), "restarts": len({pid for _t, pid, _r in s}) - 1,
                "lost": s[-1][0] < last,
                "rss_warm_mib": after[0] / _MIB if after else None,
                "rss_final_mib": float(np.mean(after[1:][-GROWTH_TAIL:])) / _MIB if len(after) > 1 else None,
                "growth": rss_growth([(t, rss) for t, _pid, rss in s], warmup_s),
                "series": [[round(t, 2), round(rss / _MIB, 2)] for t, _pid, rss in s]})
        return rows


def pool_actor_labels(live) -> dict[str, str]:
    """Actor ids of the prefill workers and decode ranks, by their pools' peer tables."""
    from ray import serve

    prefill = serve.get_deployment_handle("PrefillPoolServer", live.app_name)
    workers = sorted(prefill.peers.remote().result(timeout_s=120).items())
    named = {w._actor_id.hex(): f"PrefillWorker[{i}]" for i, (w, _info) in workers}
    named |= {r._actor_id.hex(): f"DecodeRank[{i}]" for i, r in enumerate(live.ranks)}
    return named


def plot_rss(actors: list[dict], warmup_s: float, path: str | Path) -> Path:
    """RSS (MiB) over the soak per actor, warm-up end marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for a in actors:
        t, rss = zip(*a["series"])
        ax.plot(t, rss, lw=1, label=a["label"])
    ax.axvline(warmup_s, color="k", ls="--", lw=0.8)
    ax.set_xlabel("wall time since first arrival (s)")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("soak: actor RSS (EMULATION)")
    ax.legend(fontsize=6, ncol=3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
