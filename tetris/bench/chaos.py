"""``tetris bench chaos``: open-loop load while prefill workers and decode ranks are killed.

EMULATION. What it shows: a worker that dies costs its requests time, not their answers.

1. Load: seeded Poisson arrivals at ``--load`` x capacity (``tetris bench soak``'s arrivals and
   open-loop sender), through the Ingress handle's ``generate_stream``, outputs capped.
2. Faults: every ``--kill-every`` wall seconds one worker is killed (``ray.kill``, so Ray does
   not restart it): a prefill worker and a decode TP rank in turn, each chosen by the seed. The
   app heals by itself: the pool replaces a dead worker when a chunk or the dispatcher's 2 s
   probe finds it, the dispatcher restarts a broken decode instance, and the requests they
   were serving run again and resume (``Dispatcher.generate``: ``tetris:request_retries_total``).
3. The client behaves as OpenAI's SDK does: a 429 (every decode instance down while one
   restarts) is sent again after its ``Retry-After``, up to ``--client-retries`` times; its TTFT
   counts from the first send.
4. ``--baseline`` first runs the same arrivals on a fresh app without faults, so that TTFT
   with faults is read as a ratio to TTFT without, measured in one run.

Verdict: no request failed, nothing is held after the drain, and every decode instance is
routed to again at the end.
"""

from __future__ import annotations

import asyncio
import logging
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tetris.bench.fidelity import EMULATION_LABEL, scale_deployment
from tetris.bench.soak import (OpenLoopLoad, deployment_capacity, every, held_is_zero,
                               settled_held, soak_arrivals, soak_rates)
from tetris.config import load_deployment

__all__ = ["run_chaos", "kill_schedule", "retries_by_stage", "stages", "plot_chaos"]

log = logging.getLogger(__name__)

_KINDS = ("prefill", "decode")


def kill_schedule(duration_s: float, kill_every_s: float, kinds: tuple[str, ...] = _KINDS) -> list:
    """(wall second, kind) of each kill: at kill_every, 2 kill_every, ... before the load ends,
    cycling through ``kinds``."""
    if kill_every_s <= 0:
        raise ValueError(f"--kill-every must be positive, got {kill_every_s}")
    bad = [k for k in kinds if k not in _KINDS]
    if bad or not kinds:
        raise ValueError(f"kill targets are {', '.join(_KINDS)}; got {', '.join(kinds) or 'none'}")
    n = int((duration_s - 1e-9) // kill_every_s)
    return [((i + 1) * kill_every_s, kinds[i % len(kinds)]) for i in range(n)]


def retries_by_stage(metrics_text: str) -> dict[str, int]:
    """``tetris:request_retries_total`` per stage from the dispatcher's Prometheus text."""
    out: dict[str, int] = {}
    for line in metrics_text.splitlines():
        if line.startswith("tetris:request_retries_total{"):
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            out[stage] = int(float(line.rsplit(" ", 1)[1]))
    return out


class _Client:
    """``LiveCluster.send_one`` with a client's handling of 429: send again after a second."""

    def __init__(self, live, retries: int) -> None:
        self.live, self.retries = live, retries
        self.refused = 0   # 429s answered by sending again

    async def send(self, r, request_id: str) -> dict:
        got = await self.live.send_one(r, request_id)
        for k in range(self.retries):
            if got["error"] is None or "Overloaded" not in got["error"]:
                break
            self.refused += 1
            await asyncio.sleep(1.0)
            again = await self.live.send_one(r, f"{request_id}-again{k + 1}")
            got = again | {"sent": got["sent"]}   # TTFT counts from the first send
        return got


async def _kill(live, kind: str, rng: random.Random) -> str:
    """Kill one prefill worker or one decode rank; its label."""
    import ray
    from ray import serve

    if kind == "prefill":
        peers = await serve.get_deployment_handle("PrefillPoolServer", live.app_name).peers.remote()
        label = "PrefillWorker"
    else:
        peers = await live.decode.peers.remote()
        label = "DecodeRank"
    target = rng.choice(sorted(peers))
    ray.kill(peers[target][0], no_restart=True)
    return f"{label}[{target}]"


async def _drive(live, arrivals, opts: dict, schedule: list, seed: int,
                 tick: Callable[[int], None] | None) -> tuple[OpenLoopLoad, _Client, list]:
    client = _Client(live, opts["client_retries"])
    load = OpenLoopLoad(client.send, opts["time_scale"], opts["max_inflight"])
    duration = opts["duration_s"]
    rng = random.Random(seed)
    kills: list[dict] = []
    t0 = time.perf_counter() + 0.05
    shown = [0]

    async def killer() -> None:
        for at, kind in schedule:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            kills.append({"t_s": round(time.perf_counter() - t0, 2), "kind": kind,
                          "target": await _kill(live, kind, rng)})
            log.warning("chaos: killed %s at %.1f s", kills[-1]["target"], kills[-1]["t_s"])

    async def progress(t: float) -> None:
        done = min(int(duration), int(t))
        if tick is not None and done > shown[0]:
            tick(done - shown[0])
            shown[0] = done

    await asyncio.gather(load.send(arrivals, t0, t0 + duration), killer(),
                         every(1.0, t0, duration, progress))
    await load.drain(opts["drain_timeout_s"])
    return load, client, kills


def _summary(recs: list[dict]) -> dict:
    import numpy as np

    failed = [r for r in recs if r["error"]]
    ttft = np.asarray([r["ttft"] for r in recs if r["ttft"] is not None and not r["error"]])
    pct = (lambda q: float(np.percentile(ttft, q))) if ttft.size else (lambda q: float("nan"))
    return {"sent": len(recs), "completed": len(recs) - len(failed), "failed": len(failed),
            "errors": sorted({r["error"] for r in failed})[:5],
            "ttft_s": {"p50": pct(50), "p99": pct(99)},
            # per request, in arrival order: wall seconds after the load began, TTFT (s of
            # paper time; None without a first token), whether it completed
            "requests": sorted([round(r["arrival_s"], 3), None if r["ttft"] is None else round(r["ttft"], 4),
                                not r["error"]] for r in recs)}


def stages(records: list[dict], timelines: list[dict], time_scale: float) -> list[list]:
    """Where each request's TTFT went, from the dispatcher's timelines, in arrival order:
    ``[arrival_s, queue_s, prefill_s, handoff_s, retries, decode_instance]`` (arrival in wall
    seconds after the load began, the stages in seconds of paper time; the decode instance of
    its last run). A request the dispatcher has no timeline for (refused, or dropped from its
    window) has ``None`` stages."""
    by_id = {t["request_id"]: t for t in timelines}
    rows = []
    for r in records:
        t = by_id.get(r["request_id"])
        if t is None or not t["prefill_end"]:
            rows.append([round(r["arrival_s"], 3), None, None, None]
                        + ([None, None] if t is None else [t["retries"], t["decode_instance"]]))
            continue
        b = t["breakdown"]
        handoff = b["handoff_s"] if t["first_output"] else None
        rows.append([round(r["arrival_s"], 3)]
                    + [None if v is None else round(v / time_scale, 4)
                       for v in (b["queue_s"], b["prefill_s"], handoff)]
                    + [t["retries"], t["decode_instance"]])
    return sorted(rows, key=lambda row: row[0])


def _one_run(base, tmp: Path, arrivals, opts: dict, schedule: list, seed: int, tick) -> dict:
    from tetris.bench.fidelity_live import LiveCluster

    with LiveCluster(scale_deployment(base, opts["time_scale"], tmp)) as live:
        load, client, kills = asyncio.run(_drive(live, arrivals, opts, schedule, seed, tick))
        after = {"kills": kills, "refused_then_sent_again": client.refused,
                 "app_startup_s": live.startup_s}
        try:
            timelines = live.dispatcher.timelines.remote(len(load.records) + 64).result(timeout_s=60)
            after["stages"] = stages(load.records, timelines, opts["time_scale"])
            after |= _after_load(live, opts["drain_timeout_s"])
        except Exception as e:  # noqa: BLE001 - an app that cannot answer fails the verdict
            after |= {"after_load_error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}",
                      "held_zero": False, "decode_down_at_end": None}
    return _summary(load.records) | after


def _after_load(live, wait_s: float) -> dict:
    """Healing done (every decode instance up, or ``wait_s``), then what the app holds and
    counted."""
    from ray import serve

    # healing may still be under way when the load stops: give it the drain's time
    end = time.perf_counter() + wait_s
    stats = live.dispatcher.stats.remote().result(timeout_s=60)
    while stats["decode_down"] and time.perf_counter() < end:
        time.sleep(0.5)
        stats = live.dispatcher.stats.remote().result(timeout_s=60)
    held = settled_held(live)
    metrics = live.dispatcher.metrics_text.remote().result(timeout_s=60).decode()
    prefill = serve.get_deployment_handle("PrefillPoolServer", live.app_name)
    return {"retries": retries_by_stage(metrics),
            "decode_restarts": {int(k): v for k, v in stats["decode_restarts"].items()},
            "decode_down_at_end": stats["decode_down"],
            "prefill_replacements": prefill.replacements.remote().result(timeout_s=60),
            "held_zero": held_is_zero(held), "held": held}


def run_chaos(config: str | Path | None, *, workload: str = "short", capacity: float | None = None,
              load: float = 0.5, duration_s: float = 180.0, kill_every_s: float = 30.0,
              kinds: tuple[str, ...] = _KINDS, time_scale: float = 1.0, max_output: int = 16,
              max_inflight: int = 512, drain_timeout_s: float = 120.0, client_retries: int = 10,
              seed: int = 0, baseline: bool = False, capacity_requests: int = 1000,
              tick: Callable[[int], None] | None = None) -> dict:
    """The whole benchmark (module docstring); one JSON-ready dict."""
    base = load_deployment(config or "paper-llama3-8b-emulated.toml")
    if base.prefill.executor != "emulated" or base.decode.executor != "emulated":
        raise ValueError("the chaos benchmark needs an emulated deployment "
                         "(prefill.executor = decode.executor = \"emulated\")")
    schedule = kill_schedule(duration_s, kill_every_s, kinds)
    t_start = time.perf_counter()
    cap = ({"capacity_rps": capacity, "source": "given"} if capacity else
           deployment_capacity(base, workload, requests=capacity_requests, seed=seed,
                               max_output=max_output) | {"source": "simulator"})
    rate, wall_rate = soak_rates(cap["capacity_rps"], load, time_scale)
    opts = {"time_scale": time_scale, "max_inflight": max_inflight, "duration_s": duration_s,
            "drain_timeout_s": drain_timeout_s, "client_retries": client_retries}
    runs = {}
    with tempfile.TemporaryDirectory(prefix="tetris-chaos-") as tmp:
        for name in (["baseline"] if baseline else []) + ["faults"]:
            arrivals = soak_arrivals(workload, rate, seed, max_output)   # the same, each run
            runs[name] = _one_run(base, Path(tmp) / name, arrivals, opts,
                                  schedule if name == "faults" else [], seed, tick)
    faults = runs["faults"]
    out = {"emulation": True, "label": EMULATION_LABEL, "config": base.source_path,
           "workload": workload, "seed": seed, "time_scale": time_scale, "load": load,
           "capacity": cap, "rate_rps": rate, "wall_rate_rps": wall_rate,
           "duration_s": duration_s, "kill_every_s": kill_every_s,
           "max_output_tokens": max_output, "runs": runs,
           "verdict": {"zero_failed": faults["failed"] == 0, "held_zero": faults["held_zero"],
                       "decode_all_up": faults["decode_down_at_end"] == []},
           "wall_s": time.perf_counter() - t_start}
    out["verdict"]["passed"] = all(out["verdict"].values())
    if baseline:
        b = runs["baseline"]["ttft_s"]
        out["ttft_ratio_faults_over_baseline"] = {
            q: faults["ttft_s"][q] / b[q] if b[q] > 0 else float("nan") for q in ("p50", "p99")}
    return out


def plot_chaos(out: dict, path: str | Path) -> Path:
    """TTFT of each request against when it arrived, with and without faults, kills marked;
    a request that failed is a red cross at the top. Below, when the run has them, the
    faulted run's TTFT split into its stages (queue, prefill, hand-off)."""
    from tetris.sim.plots import save_figure   # sets the Agg backend first

    import matplotlib.pyplot as plt

    split = bool(out["runs"]["faults"].get("stages"))
    fig, axes = plt.subplots(2 if split else 1, 1, figsize=(11, 8 if split else 4.5),
                             sharex=True, squeeze=False)
    ax = axes[0][0]
    styles = {"baseline": ("0.6", "without faults"), "faults": ("tab:blue", "with faults")}
    ttfts = [t for r in out["runs"].values() for _a, t, ok in r["requests"] if ok and t]
    top = max(ttfts, default=1.0) * 2
    for name, r in out["runs"].items():
        color, label = styles[name]
        done = [(a, t) for a, t, ok in r["requests"] if ok and t]
        if done:
            ax.scatter(*zip(*done), s=8, color=color, label=f"{label} ({len(done)} completed)")
        lost = [a for a, _t, ok in r["requests"] if not ok]
        if lost:
            ax.scatter(lost, [top] * len(lost), marker="x", color="tab:red", s=30,
                       label=f"failed {label} ({len(lost)})")
    for k in out["runs"]["faults"]["kills"]:
        ax.axvline(k["t_s"], color="k", ls="--", lw=0.8)
        ax.text(k["t_s"], 0.02, f" {k['target']}", rotation=90, va="bottom", fontsize=7,
                transform=ax.get_xaxis_transform())
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s, paper time)")
    ax.set_title(f"tetris bench chaos: {out['workload']}, load {out['load']:g}, "
                 f"time scale {out['time_scale']:g} (EMULATION)", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    if split:
        ax = axes[1][0]
        rows = out["runs"]["faults"]["stages"]
        for col, (name, color) in enumerate((("queue", "tab:orange"), ("prefill", "tab:green"),
                                             ("hand-off", "tab:purple")), start=1):
            pts = [(row[0], row[col]) for row in rows if row[col]]
            if pts:
                ax.scatter(*zip(*pts), s=8, color=color, label=name)
        for k in out["runs"]["faults"]["kills"]:
            ax.axvline(k["t_s"], color="k", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("with faults: stage (s, paper time)")
        ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("arrival (wall seconds after the load began)")
    return save_figure(fig, path, dpi=110)
