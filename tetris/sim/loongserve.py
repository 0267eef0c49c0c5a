"""LoongServe (unified): elastic SP over every GPU of the cluster, decode on reserved instances.

Follows research/loongserve-notes.md §5.1 at the granularity the Tetris paper compares with
(paper §7.1: TP 1 for 8B, TP 4 for 70B, single-request prefill scheduling). Model:

- All ``total_gpus / tp`` instances form one ESP pool (8B: 32 TP-1 instances on 4 nodes).
- Prefill: LoongServe's single-request ESP choice (the ``loongserve-disagg`` policy: one chunk,
  the SP size minimising the request's own TTFT, θ = 0) over the instances *not* reserved for
  decoding; reserved instances are hidden from the planner (queue time +inf).
- Decode (scale-down after prefill, §1.3 of the notes): at planning time each request gets a
  decode home, the reserved instance with the least assigned KV whose worst-case future KV
  still fits with the request added (``peak_kv``: LoongServe's admission of notes §1.7/§1.8.1,
  LightLLM's rule over each request's current tokens and remaining ``max_new_tokens``; the
  artifact's client sets ``max_new_tokens`` to the request's output length, and so do we) and
  has fewer than 128 requests (the artifact's per-master threshold);
  if none fits, a member of its own prefill group becomes a new reserved decode instance, so
  its KV lands there during the ring at no cost (proactive migration). KV going to an existing
  decode instance outside the prefill group is migrated over the NICs with the layer-wise
  overlap of ``transfer.py``.
- A reserved instance decodes its requests with continuous batching at TP ``tp`` (the decode
  model's TP-1 step time for 8B) and returns to the prefill pool when it has none left.

Simplified away (stated in docs/simulation.md): multi-master decoding and decode scale-up
(a request's KV fits one instance: 426k tokens per 8B TP-1 instance vs at most 192k here),
preemption of decoding instances by prefill (Eq. 1/2 of the notes), batched prefill (the
paper runs LoongServe with single-request scheduling), and the out-of-order dispatch window.
"""

from __future__ import annotations

import math

from tetris.control import ControlPlane, PrefillQueue
from tetris.scheduler.decode_latency import DecodeLatencyModel
from tetris.scheduler.latency import load_profile
from tetris.scheduler.policies import make_policy
from tetris.scheduler.pool import PoolState
from tetris.sim.cluster import GPUS_PER_NODE, NIC_BYTES_PER_S, ClusterSpec, Simulation
from tetris.sim.decode import DecodeInstanceSim, DecodeRequest
from tetris.sim.events import EventKind
from tetris.sim.transfer import KVTransferModel
from tetris.sim.workload import SimRequest

__all__ = ["LoongServeSimulation", "run_loongserve", "MAX_REQUESTS_PER_MASTER", "peak_kv"]

MAX_REQUESTS_PER_MASTER = 128


def peak_kv(items: list[tuple[int, int]]) -> int:
    """Worst-case future KV tokens of requests ``(current tokens, remaining new tokens)``.

    All of an instance's requests grow one token per iteration and free their KV when done, so
    usage peaks when some request finishes: with requests sorted by remaining tokens
    (descending), at the k-th one's finish ``Σ_{i<=k} cur_i + k·rem_k`` (LightLLM's
    ``_can_add_new_req``, which LoongServe's dispatcher uses; notes §1.8.1).
    """
    need = used = 0
    for k, (cur, rem) in enumerate(sorted(items, key=lambda x: -x[1]), start=1):
        used += cur
        if used + k * rem > need:
            need = used + k * rem
    return need


class _LoongDecoder(DecodeInstanceSim):
    """A reserved instance admitting by worst-case future KV rather than summed final KV.

    ``pending`` holds the requests placed here whose decoding has not started (KV in flight or
    waiting): they count in placement decisions until they join the running batch.
    """

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.pending: dict[int, DecodeRequest] = {}

    def _admit(self) -> list[DecodeRequest]:
        admitted = super()._admit()
        for req in admitted:
            del self.pending[req.index]
        return admitted

    def future_peak(self, new: tuple[int, int]) -> int:
        """``peak_kv`` of everything placed here plus a request in state ``new``."""
        items = self.outstanding() + [_state(r) for r in self.pending.values()]
        return peak_kv(items + [new])

    def can_admit(self, req: DecodeRequest) -> bool:
        if len(self.running) >= self.max_batch:
            return False
        return peak_kv(self.outstanding() + [_state(req)]) <= self.capacity

    def outstanding(self) -> list[tuple[int, int]]:
        """(current KV tokens, tokens still to generate) of each running request."""
        steps = self.steps
        return [(req.kv_tokens - (fin - steps), fin - steps) for fin, _, req in self.running]


def _state(req: DecodeRequest) -> tuple[int, int]:
    """A request not yet decoding: prompt + first token held, ``remaining`` to generate."""
    return req.kv_tokens - req.remaining, req.remaining


class LoongServeSimulation(Simulation):
    def __init__(self, requests: list[SimRequest], *, cluster: ClusterSpec, decode_step,
                 record: bool = False, workload: str = "", seed: int = 0, rate: float = 0.0,
                 execution=None):
        tp = cluster.prefill_tp
        n = cluster.total_gpus // tp
        node_size = GPUS_PER_NODE // tp
        lat = load_profile(cluster.profile)
        policy = make_policy("loongserve-disagg", lat, sp_candidates=cluster.sp_candidates)
        policy.name = "loongserve"
        # LoongServe places KV itself: the control plane has no Llumnix router here.
        control = ControlPlane(policy, PrefillQueue([i // node_size for i in range(n)]), None,
                               improvement_rate=0.0)
        super().__init__(requests, cluster=cluster, control=control, latency=lat,
                         decode_step=None, record=record, workload=workload, seed=seed, rate=rate,
                         execution=execution)
        cap = cluster.kv_capacity_tokens(tp)
        self.decoders = [_LoongDecoder(i, tp, cap, MAX_REQUESTS_PER_MASTER, decode_step)
                         for i in range(n)]
        self.link_free = [0.0] * n
        self.transfer = KVTransferModel(cluster.kv_bytes_per_token, cluster.num_layers,
                                        tp * NIC_BYTES_PER_S, tp * NIC_BYTES_PER_S)
        self.reserved = [False] * n
        self.assigned_tokens = [0] * n     # KV of requests placed on an instance, not finished
        self.assigned_count = [0] * n
        self.max_reserved = 0
        self.homes: list[int] = [-1] * len(requests)

    def _visible_pool(self, now: float) -> PoolState:
        view = self.control.queue.pool_state(now)
        for i, r in enumerate(self.reserved):
            if r:
                view.queue_times[i] = math.inf
        return view

    def _fits(self, i: int, new: tuple[int, int]) -> bool:
        if self.assigned_count[i] >= MAX_REQUESTS_PER_MASTER:
            return False
        return self.decoders[i].future_peak(new) <= self.decoders[i].capacity

    def _choose_home(self, req: DecodeRequest, group: tuple[int, ...]) -> int:
        new = _state(req)
        fits = [i for i, r in enumerate(self.reserved) if r and self._fits(i, new)]
        if fits:  # least assigned KV; a prefill-group member first (no migration); lowest index
            return min(fits, key=lambda i: (i not in group, self.assigned_tokens[i], i))
        home = group[0]
        self.reserved[home] = True
        self.max_reserved = max(self.max_reserved, sum(self.reserved))
        return home

    def _on_arrival(self, now: float, i: int) -> None:
        r = self.requests[i]
        if not any(d.can_hold(r.prompt_tokens + r.output_tokens) for d in self.decoders):
            self._refuse(now, i)     # no instance could hold its KV: refused, not planned
            return
        view = self._visible_pool(now)
        plan = self.policy.plan(r.request_id, r.prompt_tokens, now, view, improvement_rate=0.0)
        self.control.commit(plan)
        end, runs = self._execute(now, i, plan)
        req = DecodeRequest(r.request_id, i, r.prompt_tokens, r.output_tokens, end)
        kv = req.kv_tokens
        home = self._choose_home(req, plan.instances)
        self.homes[i] = home
        self.decoders[home].pending[i] = req
        self.assigned_tokens[home] += kv
        self.assigned_count[home] += 1
        if home in plan.instances:
            ready = end                       # proactive scale-down: KV written during the ring
        else:
            ready = self.transfer.ready_time(runs, self.link_free[home])
            self.link_free[home] = ready
        # Decode may start only when the instance has finished the prefill work it still owes.
        ready = max(ready, self.prefill.free_at[home])
        req.ready_time = ready
        self.decode_reqs[i] = req
        self.events.push(ready, EventKind.KV_READY, (home, req))

    def _on_kv_ready(self, now: float, d: int, req: DecodeRequest) -> None:
        super()._on_kv_ready(now, d, req)
        if req.remaining <= 0:
            self._finished(now, d, req)

    def _finished(self, now: float, d: int, req: DecodeRequest) -> None:
        self.decoders[d].pending.pop(req.index, None)  # finished without decoding
        self.assigned_tokens[d] -= req.kv_tokens
        self.assigned_count[d] -= 1
        if self.assigned_count[d] == 0:
            self.reserved[d] = False
            self.control.queue.hold([d], now)
            self.prefill.free_at[d] = max(self.prefill.free_at[d], now)

    def _step_done(self, now: float, inst: DecodeInstanceSim) -> None:
        for req in inst.finish_step(now):
            self._finished(now, inst.index, req)

    def _refresh_router(self, inst: DecodeInstanceSim) -> None:
        pass


def run_loongserve(spec, cluster: ClusterSpec, requests: list[SimRequest], execution=None):
    step = DecodeLatencyModel.for_model(cluster.model).step_time
    sim = LoongServeSimulation(requests, cluster=cluster, decode_step=step, record=spec.record,
                               workload=spec.workload, seed=spec.seed, rate=spec.rate,
                               execution=execution)
    res = sim.run()
    return res, sim
