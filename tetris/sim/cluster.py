"""The simulated cluster: the paper's deployments and the event loop that runs a workload.

The hierarchy mirrors the live system: a prefill pool (``prefill.PrefillPoolSim``) executing
the plans of a scheduler policy, KV transfer (``transfer.KVTransferModel``) and decode
instances with continuous batching (``decode.DecodeInstanceSim``), routed by the scheduler's
``DecodeRouter``. Every decision is the control plane's (``tetris.control.ControlPlane``),
called in the order the live dispatcher calls it: ``admit`` (route, plan, commit) at an
arrival, ``prefill_done`` when the last chunk ends, ``kv_arrived`` when the KV is on the
decode instance, ``decode_report`` after each decode iteration.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
import numpy as np

from tetris.control import ControlPlane
from tetris.sim.decode import DecodeInstanceSim, DecodeRequest
from tetris.sim.events import EventKind, EventQueue
from tetris.sim.metrics import SimResult, summarise, weighted_percentiles, LatencySummary
from tetris.sim.prefill import PrefillPoolSim
from tetris.sim.prefix_transfer import move_landing, with_prefix_shard
from tetris.sim.transfer import KVTransferModel
from tetris.sim.workload import SimRequest

__all__ = ["ClusterSpec", "CLUSTERS", "cluster_by_name", "Simulation"]

GB = 1e9
NIC_BYTES_PER_S = 200e9 / 8          # one 200 Gb/s InfiniBand NIC per GPU (paper §7.1)
GPUS_PER_NODE = 8
GPU_MEMORY = 80 * GB                  # A100-SXM4-80GB
MEMORY_UTILISATION = 0.9              # share of GPU memory for weights + KV (vLLM's default)


class ClusterSpec(msgspec.Struct, frozen=True):
    """A deployment of the paper (§7.1); sizes in instances, bandwidths in bytes/s."""

    model: str
    profile: str
    num_layers: int
    kv_heads: int
    head_dim: int
    params_billion: float
    prefill_instances: int
    node_size: int
    prefill_tp: int
    decode_instances: int
    decode_tp: int
    sp_candidates: tuple[int, ...]
    decode_max_batch: int = 256
    # The profile's measurement table in configs/profiles/ (None: a derived profile), which
    # execution "measured" runs on (tetris.sim.execution).
    measurements: str | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_heads * self.head_dim * 2 * 2  # K and V, 2-byte dtype

    def kv_capacity_tokens(self, tp: int) -> int:
        """KV tokens one instance of ``tp`` GPUs holds after its bf16 weights."""
        free = tp * GPU_MEMORY * MEMORY_UTILISATION - self.params_billion * 1e9 * 2
        if free <= 0:
            raise ValueError(f"{self.model} does not fit on {tp} GPUs")
        return int(free // self.kv_bytes_per_token)

    def transfer_model(self) -> KVTransferModel:
        return KVTransferModel(self.kv_bytes_per_token, self.num_layers,
                               self.prefill_tp * NIC_BYTES_PER_S, self.decode_tp * NIC_BYTES_PER_S)

    @property
    def total_gpus(self) -> int:
        return self.prefill_instances * self.prefill_tp + self.decode_instances * self.decode_tp

    def node_of(self) -> tuple[int, ...]:
        return tuple(i // self.node_size for i in range(self.prefill_instances))


# LLaMA3-8B: 4 nodes; 2 nodes of 8 TP-1 prefill instances, 2 decode instances of TP 8.
# LLaMA3-70B: 8 nodes, TP 4 everywhere; 4 nodes of 2 prefill instances, 8 decode instances.
CLUSTERS: dict[str, ClusterSpec] = {
    "8b": ClusterSpec("llama3-8b", "a100-llama3-8b-tp1", 32, 8, 128, 8.03, 16, 8, 1, 2, 8,
                      (1, 2, 4, 8, 16), measurements="paper_table1_llama3_8b_a100.csv"),
    "70b": ClusterSpec("llama3-70b", "a100-llama3-70b-tp4", 80, 8, 128, 70.6, 8, 2, 4, 8, 4,
                       (1, 2, 4, 8)),
}


def cluster_by_name(name: str) -> ClusterSpec:
    try:
        return CLUSTERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(CLUSTERS)}") from None


class Simulation:
    """One run: a workload through a control plane on a cluster. Build, then ``run()`` once.

    ``control`` holds the policy, the prefill queue, θ (fixed or from its rate monitor) and,
    when ``decode_step`` is given, the decode router. ``decode_step`` is
    ``step_time(tp, batch, context_tokens)`` (None: prefill only, as the improvement-rate
    profiler simulates).

    ``stalls`` (``prefill.Stall``) take instances out for a while, as a dead worker's
    replacement does in the live pool. ``pool_view`` is what the policy plans on: "bookings",
    the committed plans' expected ends (the live dispatcher's bookings alone, which do not
    know of a stall), or "report", also the pool's own queue (the live pool's ``busy_for``
    report: its tickets replayed, which equals this pool's ``free_at``). With an exact latency
    model and no stalls the two agree.

    ``execution`` is what a chunk takes on the simulated hardware, ``(sp, h, l) -> s``
    (``tetris.sim.execution``); None runs the plans at the scheduler's own model, ``latency``.
    """

    def __init__(self, requests: list[SimRequest], *, cluster: ClusterSpec,
                 control: ControlPlane, latency: Any, decode_step: Any = None,
                 record: bool = False, workload: str = "", seed: int = 0, rate: float = 0.0,
                 stalls: Any = (), pool_view: str = "bookings", execution: Any = None):
        if not requests:
            raise ValueError("a simulation needs at least one request")
        if pool_view not in ("bookings", "report"):
            raise ValueError(f"pool_view is 'bookings' or 'report', got {pool_view!r}")
        self.stalls = sorted(stalls, key=lambda s: s.at)
        self.report = pool_view == "report"
        if decode_step is not None and control.router is None:
            raise ValueError("decode simulation needs a control plane with a decode router")
        self.requests, self.cluster, self.control = requests, cluster, control
        self.policy = control.policy
        self.prefill = PrefillPoolSim(control.queue.size, execution or latency.predict,
                                      record=record)
        self.transfer = cluster.transfer_model()
        self.decoders = [] if decode_step is None else [
            DecodeInstanceSim(d, cluster.decode_tp, cluster.kv_capacity_tokens(cluster.decode_tp),
                              cluster.decode_max_batch, decode_step)
            for d in range(cluster.decode_instances)]
        self.link_free = [0.0] * len(self.decoders)
        self.events = EventQueue()
        n = len(requests)
        self.ttft = np.full(n, np.nan)
        self.prefill_end = np.full(n, np.nan)
        self.decode_reqs: list[DecodeRequest | None] = [None] * n
        self.refused: list[int] = []      # indices of requests no decode instance could hold
        self.chunks = 0
        self.sp_tokens = 0.0
        self.thetas: list[float] = []
        self.plans: list[Any] = [] if record else None
        self.meta = (workload, seed, rate)

    def _on_arrival(self, now: float, i: int) -> None:
        r = self.requests[i]
        while self.stalls and self.stalls[0].at <= now:
            st = self.stalls.pop(0)
            self.prefill.stall(st.instances, st.at + st.seconds)
        if self.report:   # the pool's report: what each instance still has queued (< 0: idle since)
            self.control.pool_report([f - now for f in self.prefill.free_at], now)
        control = self.control
        # Prefix caching: the prompt's block hashes reach the plane only when it has an index.
        cached = {"block_hashes": r.block_hashes} \
            if getattr(control, "prefix_index", None) is not None and r.block_hashes else {}
        if self.decoders:
            d, plan = self._admit(now, r, cached)
        else:
            plan = control.plan(r.request_id, r.prompt_tokens, now, **cached)
            control.commit(plan)
        if not self.thetas or self.thetas[-1] != control.improvement_rate:
            self.thetas.append(control.improvement_rate)
        if self.decoders and not self.decoders[d].can_hold(r.prompt_tokens + r.output_tokens):
            self._refuse(now, i)
            return
        end, runs = self._execute(now, i, plan)
        if self.decoders:
            ready = self.transfer.ready_time(self._kv_runs(plan, runs, d), self.link_free[d])
            self.link_free[d] = ready
            req = DecodeRequest(r.request_id, i, r.prompt_tokens, r.output_tokens, end)
            req.ready_time = ready
            self.decode_reqs[i] = req
            self.events.push(ready, EventKind.KV_READY, (d, req))

    def _admit(self, now: float, r: SimRequest, cached: dict) -> tuple[int, Any]:
        """Route, plan and commit an arrival: (decode instance, plan)."""
        admission = self.control.admit(r.request_id, r.prompt_tokens,
                                       r.prompt_tokens + r.output_tokens, now, **cached)
        return admission.decode_instance, admission.plan

    def _kv_runs(self, plan: Any, runs: list[Any], d: int) -> list[Any]:
        """What crosses to decode instance ``d``: the chunks, after a cached prefix's KV
        (``prefix_transfer``; ``prefix_decode`` drops it where ``d`` holds the prefix)."""
        return with_prefix_shard(plan, runs)

    def _refuse(self, now: float, i: int) -> None:
        """A request larger than its decode instance's whole KV: the live instance's reservation
        refuses it (DecodeFull, a 429) before any prefill; the plan made meanwhile is given up
        (``finished`` frees its bookings and routing). Counted in ``SimResult.refused``."""
        self.control.finished(self.requests[i].request_id, now)
        self.refused.append(i)

    def _execute(self, now: float, i: int, plan: Any) -> tuple[float, list[Any]]:
        """Run a committed plan on the simulated pool; its end is the control plane's
        ``prefill_done`` event."""
        # a moved cached prefix lands on chunk 0's group first (prefix_transfer.move_landing)
        end, runs = self.prefill.execute(plan, move_landing(
            plan, now, getattr(self.control, "prefix_move", None), self.control.queue.node_of))
        if self.plans is not None:
            self.plans.append(plan)
        self.ttft[i] = end - now
        self.prefill_end[i] = end
        self.chunks += len(runs)
        self.sp_tokens += sum(len(c.instances) * c.tokens for c in runs)
        self.events.push(end, EventKind.PREFILL_DONE, plan.request_id)
        return end, runs

    def _on_kv_ready(self, now: float, d: int, req: DecodeRequest) -> None:
        inst = self.decoders[d]
        self.control.kv_arrived(req.request_id)
        if req.remaining <= 0:
            req.finish_time = now
            return
        inst.enqueue(req)
        if not inst.stepping:
            self._start_step(now, inst)

    def _start_step(self, now: float, inst: DecodeInstanceSim) -> None:
        end = inst.start_step(now)
        self._refresh_router(inst)
        if end is not None:
            self.events.push(end, EventKind.DECODE_STEP, inst.index)

    def _on_decode_step(self, now: float, d: int) -> None:
        # Iterations that end before the next event cannot be affected by anything: run them
        # inline instead of through the heap (exact; decode dominates the event count).
        inst = self.decoders[d]
        events = self.events
        while True:
            self._step_done(now, inst)
            end = inst.start_step(now)
            if end is None or end >= events.peek_time():
                break
            now = end
        self._refresh_router(inst)
        if end is not None:
            events.push(end, EventKind.DECODE_STEP, d)

    def _step_done(self, now: float, inst: DecodeInstanceSim) -> None:
        inst.finish_step(now)

    def _refresh_router(self, inst: DecodeInstanceSim) -> None:
        waiting = sum(r.kv_tokens for r in inst.waiting)
        self.control.decode_report(inst.index, inst.free_tokens - waiting,
                                   inst.batch_size + len(inst.waiting))

    def run(self) -> SimResult:
        t_wall = time.perf_counter()
        for i, r in enumerate(self.requests):
            self.events.push(r.arrival_time, EventKind.ARRIVAL, i)
        ev = self.events
        while ev:
            now, kind, payload = ev.pop()
            if kind is EventKind.ARRIVAL:
                self._on_arrival(now, payload)
            elif kind is EventKind.PREFILL_DONE:
                self.control.prefill_done(payload, now)
                if getattr(self.control, "prefix_index", None) is not None:
                    self.control.prefix_cached(payload)
                    self.control.prefix_released()   # simulated KV needs no freeing
            elif kind is EventKind.KV_READY:
                self._on_kv_ready(now, *payload)
            elif kind is EventKind.DECODE_STEP:
                self._on_decode_step(now, payload)
        return self._result(time.perf_counter() - t_wall)

    def _tbt(self) -> tuple[LatencySummary | None, float | None, float]:
        if not self.decoders:
            return None, None, float(np.nanmax(self.prefill_end))
        durs = np.concatenate([np.asarray(d.step_durations) for d in self.decoders])
        weights = np.concatenate([np.asarray(d.step_batches, dtype=float) for d in self.decoders])
        gaps = np.array([r.second_token_time - r.first_token_time for r in self.decode_reqs
                         if r is not None and not math.isnan(r.second_token_time)])
        vals, w = np.concatenate([durs, gaps]), np.concatenate([weights, np.ones(gaps.size)])
        p50, p90, p99 = weighted_percentiles(vals, w, [50, 90, 99])
        mean = float((vals * w).sum() / w.sum()) if w.sum() > 0 else float("nan")
        t0 = self.requests[0].arrival_time
        finish = max((r.finish_time for r in self.decode_reqs if r is not None), default=t0)
        busy = sum(d.busy_s for d in self.decoders)
        util = busy / (len(self.decoders) * (finish - t0)) if finish > t0 else float("nan")
        return LatencySummary(mean, p50, p90, p99), util, finish

    def _result(self, wall: float) -> SimResult:
        n = len(self.requests)
        served = n - len(self.refused)      # throughput and per-request means: served ones
        t0 = self.requests[0].arrival_time
        last_prefill = float(np.nanmax(self.prefill_end)) if served else t0
        tbt, dutil, finish = self._tbt()
        refused = set(self.refused)
        prompt = sum(r.prompt_tokens for i, r in enumerate(self.requests) if i not in refused)
        nan = float("nan")
        workload, seed, rate = self.meta
        return SimResult(
            policy=getattr(self.policy, "name", "?"), workload=workload, model=self.cluster.model,
            rate=rate, requests=n, seed=seed, ttft=summarise(self.ttft), tbt=tbt,
            throughput_rps=served / (finish - t0) if finish > t0 else nan,
            prefill_tokens_per_s=prompt / (last_prefill - t0) if last_prefill > t0 else nan,
            prefill_utilisation=self.prefill.utilisation(t0, last_prefill) if served else nan,
            decode_utilisation=dutil, mean_chunks=self.chunks / served if served else nan,
            mean_sp=self.sp_tokens / prompt if served else nan,
            max_plan_deviation_s=self.prefill.max_plan_deviation,
            sim_wall_s=wall, sim_requests_per_s=n / wall if wall > 0 else float("inf"),
            improvement_rates=[float(t) for t in self.thetas if t is not None],
            ttft_s=[float(x) for x in self.ttft], refused=len(self.refused))
