"""``tetris bench soak``: a long open-loop run at a fraction of capacity; failures and memory.

EMULATION (issue #7: "a 10-minute soak at 70% of the emulated capacity: zero failed requests,
and no actor's memory grows by more than 5% after warm-up").

1. Capacity: the simulator's capacity of the deployment's own cluster for the workload (the
   definition of ``tetris sim capacity``, docs/simulation.md: the highest rate whose TTFT P50
   and P99 stay within 25x the light-load P50/P99), or ``--capacity``. Soak rate = load x it.
2. Load: Poisson arrivals at that rate, drawn lazily (a 10-minute run never holds its trace),
   sent open-loop through the Ingress handle's ``generate_stream`` with outputs capped; at most
   ``--max-inflight`` requests are out at once (the sender waits past that, and the lag shows).
   Time scale ``s`` as in ``tetris bench fidelity``: emulated time and arrival gaps x s.
3. Memory: every ``--sample-every`` s, the memory of every actor of the app (Serve replicas,
   the Serve controller and proxy, prefill workers, decode ranks), plus one sample after the
   drain: RSS, and the private (anonymous) part of it that the criterion reads; RSS also
   counts the pages of Ray's shared object store a process has touched (``soak_memory``).
   Growth per actor = mean of its last 3 samples / its first sample at or after warm-up - 1.
4. Verdict: ``failed == 0`` and ``max_growth <= 5%`` (an actor lost or restarted fails the
   memory criterion too); the dispatcher's held view must be empty after the drain.

The actor memory probe lives in ``tetris.bench.soak_memory``; the command line of ``tetris bench
soak`` (its options, progress bar and printout) is ``tetris/cli/bench_soak.py``.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from tetris.bench.fidelity import EMULATION_LABEL, scale_deployment, simulate, trace_for
from tetris.bench.soak_memory import ActorMemory, HeapProbe, plot_rss, pool_actor_handles
from tetris.config import DeploymentConfig, load_deployment

__all__ = ["run_soak", "soak_rates", "deployment_capacity", "soak_arrivals", "held_is_zero",
           "verdict", "OpenLoopLoad", "every", "settled_held", "MAX_GROWTH"]

MAX_GROWTH = 0.05


# -- pure parts ---------------------------------------------------------------------------------
def soak_rates(capacity_rps: float, load: float, time_scale: float) -> tuple[float, float]:
    """(paper rate, wall rate) in req/s: arrival gaps are stretched by the time scale."""
    if capacity_rps <= 0 or load <= 0 or time_scale <= 0:
        raise ValueError(f"capacity, load and time scale must be positive, got "
                         f"{capacity_rps}, {load}, {time_scale}")
    rate = load * capacity_rps
    return rate, rate / time_scale


def held_is_zero(held: dict) -> bool:
    """The dispatcher's ``held`` view (``DispatcherServer.held``) with nothing left anywhere."""
    control = all(v == 0 for v in held["dispatcher"].values())
    prefill = all(not reqs for reqs in held["prefill"].values())
    decode = all(r["empty"] for inst in held["decode"] for r in inst["ranks"])
    return control and prefill and decode


def verdict(failed: int, actors: list[dict]) -> dict:
    """The two criteria of the soak on its counts and per-actor memory rows."""
    growths = [a["growth"] for a in actors if a["growth"] is not None]
    broken = [a["label"] for a in actors if a["lost"] or a["restarts"] or a["growth"] is None]
    max_growth = max(growths) if growths else float("nan")
    memory_ok = bool(growths) and not broken and max_growth <= MAX_GROWTH
    return {"zero_failed": failed == 0, "memory_growth_ok": memory_ok, "max_growth": max_growth,
            "actors_without_verdict": broken, "passed": failed == 0 and memory_ok}


# -- capacity and arrivals ----------------------------------------------------------------------
def _light_load(cfg: DeploymentConfig, workload: str, n: int, seed: int) -> tuple[float, float]:
    """``ℓ50, ℓ99`` on the deployment's pool: each request alone at its best SP size."""
    from tetris.scheduler.latency import load_profile

    lat = load_profile(cfg.scheduler.profile or "a100-llama3-8b-tp1")
    sizes = [s for s in cfg.scheduler.sp_candidates if s <= cfg.prefill.num_instances] or [1]
    alone = [min(lat.predict(s, 0, r.prompt_tokens) for s in sizes)
             for r in trace_for(workload, 1.0, n, seed, 1)]
    return float(np.percentile(alone, 50)), float(np.percentile(alone, 99))


def deployment_capacity(cfg: DeploymentConfig, workload: str, *, requests: int = 1000,
                        seed: int = 0, tol: float = 0.05, max_output: int = 16) -> dict:
    """Bisection for the highest rate within 25x light load (``tetris.sim.experiments.capacity``'s
    criterion), on this deployment's cluster and fixed θ through ``fidelity.simulate``."""
    from tetris.sim.experiments import SLO_FACTOR

    l50, l99 = _light_load(cfg, workload, requests, seed)
    probes: list[list] = []

    def ok(rate: float) -> bool:
        t = np.asarray(simulate(cfg, trace_for(workload, rate, requests, seed, max_output))["ttft_s"])
        p50, p99 = float(np.percentile(t, 50)), float(np.percentile(t, 99))
        good = p50 <= SLO_FACTOR * l50 and p99 <= SLO_FACTOR * l99
        probes.append([rate, p50, p99, good])
        return good

    lo, hi = 0.25, 16.0
    if not ok(lo):
        raise ValueError(f"the deployment does not sustain even {lo} req/s of {workload}")
    while ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"capacity_rps": lo, "light_p50_s": l50, "light_p99_s": l99, "slo_factor": SLO_FACTOR,
            "requests": requests, "probes": probes}


def soak_arrivals(workload: str, rate: float, seed: int, max_output: int,
                  block: int = 256) -> Iterator:
    """Endless seeded Poisson arrivals (``SimRequest``), drawn ``block`` at a time."""
    from tetris.sim.workload import OUTPUT_LENGTHS, WORKLOADS, SimRequest

    if workload not in WORKLOADS:
        raise ValueError(f"the soak draws arrivals from a named workload ({sorted(WORKLOADS)}), "
                         f"got {workload!r}")
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = np.random.default_rng(seed)
    t, i = 0.0, 0
    while True:
        gaps = rng.exponential(1.0 / rate, size=block)
        prompts = WORKLOADS[workload].sample(rng, block)
        outs = OUTPUT_LENGTHS.sample(rng, block)
        for g, p, o in zip(gaps, prompts, outs):
            t += float(g)
            yield SimRequest(f"soak{i}", t, int(p), int(min(o, max_output)))
            i += 1


# -- the run ------------------------------------------------------------------------------------
class OpenLoopLoad:
    """The open-loop sender's state: per-request records and the in-flight bound. ``send(r,
    request_id)`` sends one request and returns ``LiveCluster.send_one``'s dict."""

    def __init__(self, send, time_scale: float, max_inflight: int) -> None:
        self.send_one, self.scale = send, time_scale
        self.slots = asyncio.Semaphore(max_inflight)
        self.tasks: set[asyncio.Task] = set()
        self.records: list[dict] = []
        self.peak_inflight = 0
        self.drain_s = 0.0
        self.stamp = int(time.time() * 1e3)

    async def one(self, r, due: float) -> None:
        try:
            got = await self.send_one(r, f"{r.request_id}-{self.stamp}")
        finally:
            self.slots.release()
        first = got["first"]
        self.records.append({"request_id": got["request_id"], "lag": got["sent"] - due,
                             "error": got["error"],
                             "ttft": None if first is None else (first - got["sent"]) / self.scale,
                             "arrival_s": r.arrival_time * self.scale})   # wall s after t0

    async def send(self, arrivals: Iterator, t0: float, stop: float) -> None:
        for r in arrivals:
            due = t0 + r.arrival_time * self.scale
            if due >= stop:
                return
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await self.slots.acquire()
            if time.perf_counter() >= stop:   # waited for a slot past the end of the load
                self.slots.release()
                return
            task = asyncio.create_task(self.one(r, due))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            self.peak_inflight = max(self.peak_inflight, len(self.tasks))

    async def drain(self, timeout_s: float) -> None:
        t0 = time.perf_counter()
        if self.tasks:
            _done, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self.drain_s = time.perf_counter() - t0


async def every(period: float, t0: float, until: float, fn) -> None:
    """``fn(t)`` at t = 0, period, 2·period, ... up to ``until`` (seconds since ``t0``)."""
    k = 0
    while k * period <= until:
        await asyncio.sleep(max(0.0, t0 + k * period - time.perf_counter()))
        await fn(time.perf_counter() - t0)
        k += 1


async def _drive(live, memory: ActorMemory, heap: HeapProbe, arrivals: Iterator, opts: dict,
                 tick: Callable[[int], None] | None) -> OpenLoopLoad:
    load = OpenLoopLoad(live.send_one, opts["time_scale"], opts["max_inflight"])
    duration = opts["duration_s"]
    t0 = time.perf_counter() + 0.05
    shown = [0]

    async def sample(t: float) -> None:
        await asyncio.to_thread(memory.sample, t)
        if t >= opts["warmup_s"] and not heap.started:   # the baseline of the heap reports
            await asyncio.to_thread(heap.begin)

    async def progress(t: float) -> None:
        done = min(int(duration), int(t))
        if tick is not None and done > shown[0]:
            tick(done - shown[0])
            shown[0] = done

    await asyncio.gather(load.send(arrivals, t0, t0 + duration),
                         every(opts["sample_every_s"], t0, duration, sample),
                         every(1.0, t0, duration, progress))
    await load.drain(opts["drain_timeout_s"])
    await sample(time.perf_counter() - t0)   # the idle app after the drain: what it kept
    await asyncio.to_thread(heap.end)
    return load


def settled_held(live, wait_s: float = 15.0) -> dict:
    """The held view once releases (sent after each stream ends) have landed, or at ``wait_s``."""
    end = time.perf_counter() + wait_s
    held = live.held()
    while not held_is_zero(held) and time.perf_counter() < end:
        time.sleep(0.5)
        held = live.held()
    return held


def _ttft(records: list[dict]) -> dict:
    v = np.asarray([r["ttft"] for r in records if r["ttft"] is not None and r["error"] is None])
    if v.size == 0:
        return {"p50": math.nan, "p99": math.nan, "mean": math.nan}
    return {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
            "mean": float(v.mean())}


def run_soak(config: str | Path | None, *, workload: str = "short", capacity: float | None = None,
             load: float = 0.7, duration_s: float = 600.0, warmup_s: float = 60.0,
             sample_every_s: float = 10.0, time_scale: float = 1.0, max_output: int = 16,
             max_inflight: int = 512, drain_timeout_s: float = 120.0, seed: int = 0,
             capacity_requests: int = 1000, plot: str | None = None, trace_heap: bool = False,
             tick: Callable[[int], None] | None = None) -> dict:
    """The whole soak (module docstring); one JSON-ready dict."""
    from tetris.bench.fidelity_live import LiveCluster

    if warmup_s < 0:
        raise ValueError(f"warm-up must be >= 0 s, got {warmup_s}")
    if duration_s - warmup_s < 2 * sample_every_s:
        raise ValueError("the soak needs at least two memory samples after warm-up: "
                         "duration - warmup >= 2 x sample-every")
    base = load_deployment(config or "paper-llama3-8b-emulated.toml")
    if base.prefill.executor != "emulated" or base.decode.executor != "emulated":
        raise ValueError("the soak benchmark needs an emulated deployment "
                         "(prefill.executor = decode.executor = \"emulated\")")
    t_start = time.perf_counter()
    cap = ({"capacity_rps": capacity, "source": "given"} if capacity else
           deployment_capacity(base, workload, requests=capacity_requests, seed=seed,
                               max_output=max_output) | {"source": "simulator"})
    rate, wall_rate = soak_rates(cap["capacity_rps"], load, time_scale)
    arrivals = soak_arrivals(workload, rate, seed, max_output)
    opts = {"time_scale": time_scale, "max_inflight": max_inflight, "duration_s": duration_s,
            "sample_every_s": sample_every_s, "drain_timeout_s": drain_timeout_s,
            "warmup_s": warmup_s}
    with tempfile.TemporaryDirectory(prefix="tetris-soak-") as tmp:
        with LiveCluster(scale_deployment(base, time_scale, Path(tmp))) as live:
            pool = pool_actor_handles(live)
            memory = ActorMemory(live.app_name, {aid: label for aid, (label, _h) in pool.items()})
            heap = HeapProbe(memory, pool, trace=trace_heap)
            sent = asyncio.run(_drive(live, memory, heap, arrivals, opts, tick))
            held = settled_held(live)
            startup_s = live.startup_s
    actors = memory.report(warmup_s)
    recs = sent.records
    failed = [r for r in recs if r["error"]]
    lags = [r["lag"] for r in recs]
    out = {"emulation": True, "label": EMULATION_LABEL, "config": base.source_path,
           "workload": workload, "seed": seed, "time_scale": time_scale, "load": load,
           "capacity": cap, "rate_rps": rate, "wall_rate_rps": wall_rate,
           "duration_s": duration_s, "warmup_s": warmup_s, "sample_every_s": sample_every_s,
           "max_output_tokens": max_output,
           "requests": {"sent": len(recs), "completed": len(recs) - len(failed),
                        "failed": len(failed), "peak_inflight": sent.peak_inflight,
                        "errors": sorted({r["error"] for r in failed})[:5]},
           "ttft_s": _ttft(recs),
           "arrival_lag_ms_p99": float(np.percentile(lags, 99) * 1e3) if lags else 0.0,
           "memory": {"samples": len(memory.times), "actors": actors, "heap_traced": trace_heap,
                      "heap": heap.diffs()},
           "held": held, "held_zero": held_is_zero(held),
           "verdict": verdict(len(failed), actors), "app_startup_s": startup_s,
           "drain_s": sent.drain_s, "wall_s": time.perf_counter() - t_start}
    if plot:
        out["plot"] = str(plot_rss(actors, warmup_s, plot))
    return out
