"""Memory of a live app's actors for ``tetris bench soak``: RSS and private memory by pid,
growth, a plot.

Every sample lists the ALIVE actors of the Ray cluster and keeps those of the app: the pools'
prefill workers and decode ranks (by the actor ids in the pools' peer tables), the app's Serve
replicas (class ``ServeReplica:<app>:<deployment>``), and Serve's controller and proxy. RSS is
read from /proc/PID/status; an actor is keyed by its id, so a restart shows as a second pid.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

__all__ = ["ActorMemory", "HeapProbe", "rss_growth", "pool_actor_handles",
           "plot_rss", "GROWTH_TAIL"]

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
    """actor id (hex) -> (class name, pid) of every ALIVE actor (see ``_alive_table``)."""
    return {aid: (cls, pid) for aid, (cls, pid, _name) in _alive_table().items()}


def _alive_table() -> dict[str, tuple[str, int, str]]:
    """actor id (hex) -> (class name, pid, name) of every ALIVE actor.

    ``ray.util.state.list_actors`` goes through the dashboard, which the benchmark does not start
    (and which finds several clusters on a shared machine); the GCS table needs neither.
    """
    try:
        from ray._private.state import actors
    except ImportError:  # pragma: no cover - a Ray without the private table
        from ray.util.state import list_actors

        return {a.actor_id: (a.class_name, a.pid, a.name or "")
                for a in list_actors(filters=[("state", "=", "ALIVE")], limit=100_000)}
    return {aid: (a["ActorClassName"], a["Pid"], a["Name"]) for aid, a in sorted(actors().items())
            if a["State"] == "ALIVE"}


class ActorMemory:
    """RSS series of the app's actors: named pool actors plus Serve's replicas of the app and
    its controller and proxy, found again at every sample (a restarted actor shows a new pid)."""

    SERVE_SYSTEM = ("ServeController", "ProxyActor")

    def __init__(self, app_name: str, named: dict[str, str]) -> None:
        self.prefix = f"ServeReplica:{app_name}:"
        self.named = dict(named)                       # actor id -> label
        # id -> (t, pid, rss, private, shared): bytes (``_proc_memory``)
        self.series: dict[str, list[tuple[float, int, int, int, int]]] = {}
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
        for aid, (cls, pid) in _alive_actors().items():
            label = self._label(aid, cls)
            if label is None or not pid:
                continue
            try:
                rss, private, shared = _proc_memory(pid)
            except OSError:   # gone between the table and the read: counted as lost later
                continue
            self.series.setdefault(aid, []).append((t, pid, rss, private, shared))
            self.classes[aid], self.labels[aid] = cls, label
        self.times.append(t)

    def report(self, warmup_s: float) -> list[dict]:
        last = self.times[-1] if self.times else 0.0
        rows = []
        for aid in sorted(self.series, key=lambda a: (self.labels[a], a)):
            s = self.series[aid]
            after = [x for x in s if x[0] >= warmup_s]

            def warm_final(k: int) -> tuple[float | None, float | None]:
                return (after[0][k] / _MIB if after else None,
                        float(np.mean([x[k] for x in after[1:][-GROWTH_TAIL:]])) / _MIB
                        if len(after) > 1 else None)

            (rss_w, rss_f), (prv_w, prv_f), (shm_w, shm_f) = (warm_final(k) for k in (2, 3, 4))
            rows.append({
                "label": self.labels[aid], "class_name": self.classes[aid], "pid": s[-1][1],
                "samples": len(s), "restarts": len({x[1] for x in s}) - 1,
                "lost": s[-1][0] < last,
                "rss_warm_mib": rss_w, "rss_final_mib": rss_f,
                "private_warm_mib": prv_w, "private_final_mib": prv_f,
                "shared_growth_mib": None if shm_f is None else shm_f - shm_w,
                # the criterion: the process's own (anonymous) memory; see _proc_memory
                "growth": rss_growth([(x[0], x[3]) for x in s], warmup_s),
                "rss_growth": rss_growth([(x[0], x[2]) for x in s], warmup_s),
                "series": [[round(x[0], 2), round(x[2] / _MIB, 2), round(x[3] / _MIB, 2)]
                           for x in s]})
        return rows


def _proc_memory(pid: int) -> tuple[int, int, int]:
    """(RSS, private, shared) bytes of a process.

    private = anonymous pages: the process's own memory (heaps, pymalloc arenas, stacks).
    shared = ``RssShmem``: pages of shared memory it has touched, here Ray's object store
    (/dev/shm): an argument past Ray's inline limit (100 kB, e.g. a 24k-token prompt as a
    tuple) is read from the store in place, and as the store places objects at new offsets the
    reader can touch new pages, which RSS counts though the process holds nothing (a few MiB in
    a soak: docs/soak.md). RSS also counts file pages (shared libraries).

    RSS and private come from ``/proc/PID/smaps_rollup``, which walks the page tables. The
    counters in ``/proc/PID/status`` are cheaper but can lag: kernels before 6.2 keep them per
    thread and fold them in only every 64 page faults, so 32 MiB faulted in as 16 huge pages
    may not show at all. ``status`` is the fallback where ``smaps_rollup`` cannot be read.
    """
    status = _kib_fields(f"/proc/{pid}/status", ("VmRSS", "RssAnon", "RssShmem"))
    try:
        rollup = _kib_fields(f"/proc/{pid}/smaps_rollup", ("Rss", "Anonymous"))
    except OSError:     # no such file on this kernel, not ours to read, or just exited
        rollup = {}
    if "Rss" in rollup and "Anonymous" in rollup:
        return rollup["Rss"], rollup["Anonymous"], status.get("RssShmem", 0)
    return status["VmRSS"], status["RssAnon"], status.get("RssShmem", 0)


def _kib_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """The ``Key:  N kB`` lines of a /proc file named in ``keys``, in bytes."""
    fields = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                fields[key] = int(value.split()[0]) * 1024
    return fields


def pool_actor_handles(live) -> dict[str, tuple[str, object]]:
    """actor id -> (label, handle) of the prefill workers and decode ranks, by the pools' peer
    tables."""
    from ray import serve

    prefill = serve.get_deployment_handle("PrefillPoolServer", live.app_name)
    workers = sorted(prefill.peers.remote().result(timeout_s=120).items())
    named = {w._actor_id.hex(): (f"PrefillWorker[{i}]", w) for i, (w, _info) in workers}
    named |= {r._actor_id.hex(): (f"DecodeRank[{i}]", r) for i, r in enumerate(live.ranks)}
    return named


class HeapProbe:
    """``tetris.bench.heap_probe`` reports of the app's Tetris processes at warm-up end and at the end.

    ``begin`` (at the warm-up's end) takes a report in every Serve replica of the app and every
    pool actor, and with ``trace`` starts tracemalloc there first; ``end`` (after the drain)
    takes the second report and stops tracing. ``diffs()`` is per label what grew in between:
    Python objects by type, glibc's in-use and free bytes, and with tracing the allocation
    sites. Serve's controller and proxy are left out (not Tetris code).
    """

    def __init__(self, memory: ActorMemory, pool_handles: dict[str, tuple[str, object]],
                 trace: bool = False, timeout_s: float = 300.0) -> None:
        self.memory, self.pool, self.trace, self.timeout_s = memory, pool_handles, trace, timeout_s
        self.before: dict[str, dict] = {}
        self.after: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        self._labels: dict[str, str] = {}
        self._handles: dict[str, tuple[str, object]] = {}

    def _targets(self) -> dict[str, tuple[str, object]]:
        import ray

        out = dict(self.pool)
        for aid, (cls, _pid, name) in _alive_table().items():
            if cls.startswith(self.memory.prefix) and name:
                try:
                    out[aid] = (cls[len(self.memory.prefix):], ray.get_actor(name, namespace="serve"))
                except ValueError as e:   # gone since the table was read
                    self.errors[aid] = str(e)
        return out

    def _call_all(self, action: str, targets: dict) -> dict[str, object]:
        """``action`` in every target at once, each on a thread of its own there (an async
        replica's event loop keeps answering health checks), polled until done or timeout."""
        import ray

        from tetris.bench.heap_probe import ray_call

        tokens: dict[str, str] = {}
        refs = {aid: h.__ray_call__.remote(ray_call, "submit", action=action)
                for aid, (_l, h) in targets.items()}
        for aid, ref in refs.items():
            try:
                tokens[aid] = ray.get(ref, timeout=60)
            except Exception as e:  # noqa: BLE001 - one dead actor must not lose the others' data
                self.errors[aid] = _brief(e)
        out: dict[str, object] = {}
        end = time.monotonic() + self.timeout_s
        while tokens and time.monotonic() < end:
            for aid, token in list(tokens.items()):
                try:
                    done, result = ray.get(targets[aid][1].__ray_call__.remote(
                        ray_call, "poll", token=token), timeout=60)
                except Exception as e:  # noqa: BLE001
                    self.errors[aid] = _brief(e)
                    del tokens[aid]
                    continue
                if done:
                    out[aid] = result
                    del tokens[aid]
            if tokens:
                time.sleep(1.0)
        for aid in tokens:
            self.errors[aid] = f"{action} took longer than {self.timeout_s:g} s"
        return out

    @property
    def started(self) -> bool:
        return bool(self._handles)

    def begin(self) -> None:
        targets = self._targets()
        self._labels = {aid: label for aid, (label, _h) in targets.items()}
        self._handles = targets
        if self.trace:
            self._call_all("trace_start", targets)
        self.before = self._call_all("report", targets)

    def end(self) -> None:
        if not self.before:
            return
        self.after = self._call_all("report", self._handles)
        if self.trace:
            self._call_all("trace_stop", self._handles)

    def diffs(self) -> dict[str, dict]:
        from tetris.bench.heap_probe import heap_diff

        out: dict[str, dict] = {}

        def key(aid: str) -> str:   # a label shared by two actors (two replicas) gets the id
            label = self._labels.get(aid, aid)
            return label if label not in out else f"{label}#{aid[:8]}"

        for aid in sorted(self.before, key=lambda a: (self._labels[a], a)):
            if aid in self.errors:
                continue
            if aid not in self.after or self.after[aid]["pid"] != self.before[aid]["pid"]:
                out[key(aid)] = {"error": "restarted or lost between the two reports"}
            else:
                out[key(aid)] = heap_diff(self.before[aid], self.after[aid])
        for aid, err in sorted(self.errors.items()):
            out[key(aid)] = {"error": err}
        return out


def _brief(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def plot_rss(actors: list[dict], warmup_s: float, path: str | Path) -> Path:
    """RSS and private memory (MiB) over the soak per actor, warm-up end marked."""
    from tetris.sim.plots import save_figure   # sets the Agg backend first

    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    for a in actors:
        t, rss, private = zip(*a["series"])
        axes[0].plot(t, rss, lw=1, label=a["label"])
        axes[1].plot(t, private, lw=1, label=a["label"])
    for ax, what in zip(axes, ("RSS", "private (anonymous) memory, the criterion")):
        ax.axvline(warmup_s, color="k", ls="--", lw=0.8)
        ax.set_xlabel("wall time since first arrival (s)")
        ax.set_ylabel("MiB")
        ax.set_title(f"soak: actor {what} (EMULATION)", fontsize=10)
    axes[1].legend(fontsize=6, ncol=2)
    return save_figure(fig, path, dpi=110)
