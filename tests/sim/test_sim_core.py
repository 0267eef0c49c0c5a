import json

import numpy as np
import pytest

from tetris.plan import Chunk, PrefillPlan
from tetris.control import ControlPlane, PrefillQueue
from tetris.sim.cluster import CLUSTERS, Simulation
from tetris.sim.decode import DecodeInstanceSim, DecodeRequest
from tetris.sim.events import EventKind, EventQueue
from tetris.sim.prefill import PrefillPoolSim
from tetris.sim.workload import (OUTPUT_LENGTHS, WORKLOADS, SimRequest, load_trace,
                                 output_lengths, poisson_workload, save_trace, scale_to_rate)

from sim_helpers import LeastQueuePolicy, LinearLatency, MostFreeRouter


def test_events_order_by_time_then_kind_then_sequence():
    q = EventQueue()
    q.push(2.0, EventKind.ARRIVAL, "late")
    q.push(1.0, EventKind.ARRIVAL, "a1")
    q.push(1.0, EventKind.DECODE_STEP, "step")
    q.push(1.0, EventKind.ARRIVAL, "a2")
    q.push(1.0, EventKind.KV_READY, "kv")
    assert [q.pop()[2] for _ in range(5)] == ["kv", "step", "a1", "a2", "late"]
    with pytest.raises(ValueError):
        q.push(float("nan"), EventKind.ARRIVAL)


@pytest.mark.parametrize("name", ["short", "medium", "long"])
def test_length_distributions_match_paper_ranges_and_means(name):
    d = WORKLOADS[name]
    x = d.sample(np.random.default_rng(1), 20000)
    assert x.min() >= d.min_tokens and x.max() <= d.max_tokens
    assert abs(x.mean() / d.mean_tokens - 1) < 0.02


def test_poisson_workload_is_seeded_and_rate_only_scales_time():
    a = poisson_workload(WORKLOADS["short"], 1.0, 200, seed=3)
    b = poisson_workload(WORKLOADS["short"], 4.0, 200, seed=3)
    c = poisson_workload(WORKLOADS["short"], 1.0, 200, seed=4)
    assert [r.prompt_tokens for r in a] == [r.prompt_tokens for r in b]
    assert np.allclose([r.arrival_time / 4 for r in a], [r.arrival_time for r in b])
    assert [r.prompt_tokens for r in a] != [r.prompt_tokens for r in c]
    rate = (len(a) - 1) / (a[-1].arrival_time - a[0].arrival_time)
    assert 0.8 < rate < 1.2


@pytest.mark.parametrize("mean", [384, 1024, 2048])
def test_output_mean_option_sets_the_sampled_output_mean(mean):
    from tetris.sim.experiments import make_requests
    d = output_lengths(mean)
    assert d.min_tokens == 32 and d.max_tokens == max(2048, round(2048 * mean / 384))
    reqs = make_requests("short", 1.0, 4000, 0, output_mean=mean)
    outs = np.array([r.output_tokens for r in reqs])
    assert outs.min() >= 32 and outs.max() <= d.max_tokens
    assert abs(outs.mean() / mean - 1) < 0.05
    # Prompts and arrivals do not depend on the output mean; the default is unchanged.
    base = make_requests("short", 1.0, 4000, 0)
    assert [r.prompt_tokens for r in reqs] == [r.prompt_tokens for r in base]
    assert output_lengths() is OUTPUT_LENGTHS


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_trace_round_trip_and_scaling(tmp_path, suffix):
    reqs = [SimRequest("x", 0.0, 100, 5), SimRequest("y", 2.0, 300, 7), SimRequest("z", 4.0, 50, 1)]
    p = tmp_path / f"t{suffix}"
    save_trace(reqs, p)
    assert load_trace(p) == reqs
    scaled = scale_to_rate(reqs, 2.0)
    assert [r.arrival_time for r in scaled] == [0.0, 0.5, 1.0]


def test_trace_errors_name_the_row(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"arrival_time": 0, "prompt_tokens": 10, "output_tokens": 2}) + "\n"
                 + json.dumps({"arrival_time": 1, "prompt_tokens": 0, "output_tokens": 2}) + "\n")
    with pytest.raises(ValueError, match="row 1"):
        load_trace(p)
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "missing.csv")


def test_chunk_waits_for_every_group_member_and_previous_chunk():
    lat = LinearLatency()
    pool = PrefillPoolSim(3, lat.predict)
    pool.free_at = [0.0, 5.0, 0.0]
    plan = PrefillPlan("r", 2000, (Chunk(0, 1000, (0,), 0.0, 0.11),
                                   Chunk(1000, 2000, (0, 1), 5.0, 5.0 + 0.11 / 2)))
    end, runs = pool.execute(plan, arrival=0.0)
    assert runs[0].start == 0.0 and runs[0].end == pytest.approx(0.11)
    assert runs[1].start == 5.0  # instance 1 is busy until 5
    assert end == pytest.approx(5.055)
    assert pool.free_at == [pytest.approx(5.055), pytest.approx(5.055), 0.0]
    assert pool.max_plan_deviation == pytest.approx(0.0, abs=1e-12)


def test_decode_instance_continuous_batching_admits_and_finishes():
    step = lambda tp, b, ctx: 0.01 + 0.001 * b
    d = DecodeInstanceSim(0, 8, kv_capacity_tokens=250, max_batch_size=4, step_time=step)
    a = DecodeRequest("a", 0, 100, 3, first_token_time=0.0)   # 2 decode steps
    b = DecodeRequest("b", 1, 100, 2, first_token_time=0.0)   # 1 decode step
    c = DecodeRequest("c", 2, 100, 2, first_token_time=0.0)   # must wait: 250 tokens hold two
    for r in (a, b, c):
        d.enqueue(r)
    t = d.start_step(0.0)
    assert t == pytest.approx(0.012) and d.batch_size == 2 and len(d.waiting) == 1
    assert [r.request_id for r in d.finish_step(t)] == ["b"]
    t2 = d.start_step(t)  # c admitted now that b freed its KV
    assert d.batch_size == 2 and t2 == pytest.approx(t + 0.012)
    assert sorted(r.request_id for r in d.finish_step(t2)) == ["a", "c"]
    assert d.start_step(t2) is None and d.used_tokens == 0 and d.context_tokens == 0
    assert a.second_token_time == pytest.approx(0.012) and c.second_token_time == pytest.approx(t2)


def _tiny_sim(n=40, rate=20.0, seed=0, sp=1, decode=True):
    spec = CLUSTERS["8b"]
    lat = LinearLatency()
    reqs = [SimRequest(r.request_id, r.arrival_time, r.prompt_tokens // 100, r.output_tokens // 20 + 1)
            for r in poisson_workload(WORKLOADS["short"], rate, n, seed)]
    router = MostFreeRouter(spec.decode_instances)
    control = ControlPlane(LeastQueuePolicy(lat, sp), PrefillQueue([0, 0, 1, 1]),
                           router if decode else None, improvement_rate=None)
    sim = Simulation(reqs, cluster=spec, control=control, latency=lat,
                     decode_step=(lambda tp, b, ctx: 0.005 + 1e-4 * b) if decode else None,
                     record=True)
    return sim, sim.run(), reqs, router


def test_simulation_ttft_matches_queueing_by_hand():
    sim, res, reqs, router = _tiny_sim()
    lat = LinearLatency()
    free = [0.0] * 4
    expect = []
    for r in reqs:  # least-queue SP-1 by hand
        i = min(range(4), key=lambda k: (free[k], k))
        start = max(free[i], r.arrival_time)
        free[i] = start + lat.predict(1, 0, r.prompt_tokens)
        expect.append(free[i] - r.arrival_time)
    assert np.allclose(res.ttft_s, expect)
    assert res.max_plan_deviation_s == pytest.approx(0.0, abs=1e-9)
    assert all(r is not None and r.finish_time >= r.ready_time >= r.first_token_time
               for r in sim.decode_reqs)
    assert res.tbt is not None and res.tbt.p50 > 0.005 and res.throughput_rps > 0
    assert router.virtual == [0, 0] and router.calls
    assert 0 < res.prefill_utilisation <= 1 and res.mean_chunks == 1 and res.mean_sp == 1


def test_simulation_is_deterministic_and_sp_shortens_light_load_ttft():
    _, a, _, _ = _tiny_sim(seed=5, rate=2.0)
    _, b, _, _ = _tiny_sim(seed=5, rate=2.0)
    _, c, _, _ = _tiny_sim(seed=5, rate=2.0, sp=4, decode=False)
    assert a.ttft_s == b.ttft_s
    assert c.ttft.p50 < a.ttft.p50 and c.tbt is None


def test_a_stall_delays_what_is_placed_after_it_and_is_checked():
    pool = PrefillPoolSim(3, LinearLatency().predict)
    pool.free_at = [1.0, 0.0, 9.0]
    pool.stall((0, 2), until=5.0)
    assert pool.free_at == [5.0, 0.0, 9.0]     # a later free time stands
    _, runs = pool.execute(PrefillPlan("r", 1000, (Chunk(0, 1000, (0,), 0.0, 0.11),)), arrival=2.0)
    assert runs[0].start == 5.0 and pool.busy_s == [pytest.approx(0.11), 0.0, 0.0]
    with pytest.raises(ValueError, match="no prefill instance 3"):
        pool.stall((3,), until=1.0)


def test_after_a_stall_planning_on_the_pools_report_recovers_sooner_than_on_bookings():
    """The live dispatcher's view after a dead worker (tetris/serve/dispatcher.py LiveQueue):
    its bookings alone say the pool is free once their planned ends pass; the pool's report
    says what is still queued. 16 instances, Short at 3.5 req/s (about half Tetris's
    capacity), all instances stalled 20 s at t = 60 s (a worker replaced while the others wait
    behind its requests' tickets)."""
    from tetris.sim.experiments import RunSpec, run_one
    from tetris.sim.prefill import Stall

    spec = RunSpec(model="8b", workload="short", rate=3.5, requests=700, seed=0, decode=False,
                   improvement_rate=0.3)
    stall = [Stall(60.0, tuple(range(16)), 20.0)]
    means = {}
    for view in ("bookings", "report"):
        _, sim = run_one(spec, stalls=stall, pool_view=view)
        arrival = np.array([r.arrival_time for r in sim.requests])
        during = (arrival >= 60.0) & (arrival < 80.0)
        # whatever the view, a request arriving in the stall waits out the rest of it
        assert np.all(sim.ttft[during] >= 80.0 - arrival[during] - 1e-9)
        after = (arrival >= 80.0) & (arrival < 140.0)
        means[view] = float(np.mean(sim.ttft[after]))
    _, calm = run_one(spec)
    calm_arrival = np.array([r.arrival_time for r in calm.requests])
    calm_mean = float(np.mean(calm.ttft[(calm_arrival >= 80.0) & (calm_arrival < 140.0)]))
    assert means["report"] < 0.75 * means["bookings"]
    assert calm_mean < means["report"]
    # no stall: the two views plan alike (exact latency model)
    a, _ = run_one(spec, pool_view="bookings")
    b, _ = run_one(spec, pool_view="report")
    assert a.ttft_s == pytest.approx(b.ttft_s, rel=1e-9)
    with pytest.raises(ValueError, match="pool_view"):
        run_one(spec, pool_view="oracle")
