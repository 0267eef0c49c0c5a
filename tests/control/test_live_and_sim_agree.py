"""One control plane, two drivers: the live dispatcher and the simulator, given the same seeded
arrivals and the same pool events, make the same (route, plan) decisions.

The simulator runs first on a small cluster (4 prefill instances on 2 nodes, 2 decode
instances). Every call it makes on its ``ControlPlane`` is recorded with its time. The live
``Dispatcher`` then serves the same requests through in-process fakes of the two pools on a
virtual clock: a request arrives when the simulator's did, its prefill ends when the
simulated pool finished it, its KV arrives when the simulated transfer delivered it, and the
decode instances report the loads the simulated ones reported. What the dispatcher decides in
between (route, plan, commit) is its own work, through its own ``ControlPlane``.
"""

from __future__ import annotations

import asyncio

import msgspec

from tetris.config import load_deployment
from tetris.control import ControlPlane, PrefillQueue
from tetris.engine.request import OutputDelta
from tetris.sampling_params import SamplingParams
from tetris.scheduler.latency import load_profile
from tetris.scheduler.policies import policy_from_config
from tetris.scheduler.router import DecodeRouter
from tetris.serve.dispatcher import Dispatcher
from tetris.serve.protocol import GenerateRequest
from tetris.sim.cluster import CLUSTERS, Simulation
from tetris.sim.workload import WORKLOADS, SimRequest, poisson_workload

NODE_OF = [0, 0, 1, 1]


class Recording(ControlPlane):
    """A control plane that logs every event it is told, and its decisions."""

    def __init__(self, *args, clock=None, **kw) -> None:
        super().__init__(*args, **kw)
        self.clock = clock
        self.log: list[tuple] = []
        self.decisions: list[tuple] = []

    def route(self, run_id, kv_tokens, avoid=frozenset()):
        d = super().route(run_id, kv_tokens, avoid)
        self.decisions.append(("route", run_id, d))
        return d

    def plan(self, run_id, prompt_tokens, now, *, arrival=True):
        p = super().plan(run_id, prompt_tokens, now, arrival=arrival)
        self.log.append((now, "arrival", run_id))
        chunks = tuple((c.start, c.end, c.instances, round(c.expected_end, 9)) for c in p.chunks)
        self.decisions.append(("plan", run_id, chunks))
        return p

    def prefill_done(self, run_id, now):
        self.log.append((now, "prefill_done", run_id))
        super().prefill_done(run_id, now)

    def kv_arrived(self, run_id):
        self.log.append((self.clock() if self.clock else None, "kv_arrived", run_id))
        super().kv_arrived(run_id)

    def decode_report(self, instance, free_slots, batch_size):
        self.log.append((None, "decode_report", (instance, free_slots, batch_size)))
        super().decode_report(instance, free_slots, batch_size)


def _requests() -> list[SimRequest]:
    reqs = poisson_workload(WORKLOADS["short"], rate=4.0, n=40, seed=7)
    # shorter outputs keep the live replay small; the decisions do not depend on them
    return [msgspec.structs.replace(r, prompt_tokens=r.prompt_tokens // 4,
                                    output_tokens=min(r.output_tokens, 64)) for r in reqs]


def _cluster():
    return msgspec.structs.replace(CLUSTERS["8b"], prefill_instances=4, node_size=2,
                                   decode_instances=2, sp_candidates=(1, 2, 4))


def _simulate(dep, reqs):
    cluster = _cluster()
    cap = cluster.kv_capacity_tokens(cluster.decode_tp)
    policy = policy_from_config(dep.scheduler)
    control = Recording(policy, PrefillQueue(NODE_OF), DecodeRouter([cap, cap]),
                        improvement_rate=dep.scheduler.improvement_rate)
    sim = Simulation(reqs, cluster=cluster, control=control, latency=load_profile(
        dep.scheduler.profile or "a100-llama3-8b-tp1"),
        decode_step=lambda tp, batch, ctx: 0.02 + 1e-4 * batch)
    # record when each KV arrived: the simulator calls kv_arrived from its event loop
    times: dict[str, float] = {}
    orig = sim._on_kv_ready

    def on_kv_ready(now, d, req):
        times[req.request_id] = now
        orig(now, d, req)

    sim._on_kv_ready = on_kv_ready
    sim.run()
    log = [(t if kind != "kv_arrived" else times[p], kind, p) for t, kind, p in control.log]
    return control, log, cap


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class _Result(msgspec.Struct):
    first_token: int
    elapsed_s: float
    turn_wait_s: float = 0.0


class ReplayPrefill:
    """A prefill pool whose runs end when the test says (the simulated pool's end)."""

    def __init__(self) -> None:
        self.done: dict[str, asyncio.Future] = {}

    async def commit(self, plan, wait_replacing=False):
        self.done[plan.request_id] = asyncio.get_running_loop().create_future()

    async def busy_for(self):
        return None

    async def run(self, plan, token_ids, sampling, kv_receivers):
        await self.done[plan.request_id]
        return _Result(first_token=1, elapsed_s=0.0)

    async def release(self, request_id):
        pass

    async def abort(self, request_id):
        pass


class _Stats(msgspec.Struct):
    free_blocks: int
    block_size: int
    running: int


class ReplayDecode:
    """Decode instances whose KV arrives when the test says; they report given loads."""

    def __init__(self) -> None:
        self.arrived: dict[str, asyncio.Future] = {}
        self.max_tokens: dict[str, int] = {}
        self.stats_now: list = [None, None]

    def receiver_ids(self, instance):
        return (instance,)

    async def reserve(self, instance, request_id, prompt, sampling, generated=()):
        self.arrived[request_id] = asyncio.get_running_loop().create_future()
        self.max_tokens[request_id] = sampling.max_tokens

    async def commit(self, instance, request_id, first_token):
        pass

    async def stream(self, instance, request_id):
        await self.arrived[request_id]
        n = self.max_tokens[request_id]
        yield OutputDelta(request_id, (1,) * n, "", n, True, "length")

    async def abort(self, instance, request_id):
        pass

    async def stats(self):
        return list(self.stats_now)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def _replay(dep, reqs, log, cap) -> Recording:
    clock, prefill, decode = _Clock(), ReplayPrefill(), ReplayDecode()
    d = Dispatcher(dep, prefill, decode, node_of=NODE_OF, decode_capacities=[cap, cap],
                   clock=clock)
    c = d.control
    d.control = Recording(c.policy, c.queue, c.router, improvement_rate=c.improvement_rate,
                          monitor=c.monitor, clock=clock)
    by_id = {r.request_id: r for r in reqs}
    tasks = []

    async def serve(r: SimRequest) -> None:
        req = GenerateRequest(r.request_id, tuple(range(1, r.prompt_tokens + 1)),
                              SamplingParams(max_tokens=r.output_tokens))
        async for _ in d.generate(req):
            pass

    for t, kind, payload in log:
        if t is not None:
            clock.t = t
        if kind == "arrival":
            tasks.append(asyncio.ensure_future(serve(by_id[payload])))
        elif kind == "prefill_done":
            prefill.done[payload].set_result(None)
        elif kind == "kv_arrived":
            decode.arrived[payload].set_result(None)
        elif kind == "decode_report":
            i, free, batch = payload
            decode.stats_now = [None, None]
            decode.stats_now[i] = _Stats(free, 1, batch)
            await d.refresh_decode_load()
        await _settle()
    await asyncio.gather(*tasks)
    assert d.held() == {"inflight": 0, "queue_bookings": 0, "virtual_usage": 0,
                        "virtual_requests": 0, "cleanups": 0, "relayed": 0}
    return d.control


def test_the_live_dispatcher_and_the_simulator_make_the_same_decisions():
    dep = load_deployment(None)
    reqs = _requests()
    sim_control, log, cap = _simulate(dep, reqs)
    live_control = asyncio.run(_replay(dep, reqs, log, cap))
    assert len(sim_control.decisions) == 2 * len(reqs)
    assert live_control.decisions == sim_control.decisions
    # the decisions are not trivial: both decode instances, several group sizes, queueing
    routes = {d for kind, _, d in sim_control.decisions if kind == "route"}
    sizes = {len(c[2]) for kind, _, chunks in sim_control.decisions if kind == "plan"
             for c in chunks}
    multi = sum(1 for kind, _, chunks in sim_control.decisions if kind == "plan" and len(chunks) > 1)
    assert routes == {0, 1} and len(sizes) >= 2 and multi >= 1
