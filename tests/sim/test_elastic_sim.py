"""Elastic decode in the simulator (tetris/sim/elastic.py, elastic_runs.py): off, the cluster
run equals the plain simulator's bit for bit; a sharded request's holders hold and read its
ranges and its master steps in lockstep with them; on the 70B cluster a 1M-token tail that
fits no decode instance is refused whole and served elastic, with nothing left held."""

from __future__ import annotations

import pytest

from tetris.control import ControlPlane, PrefillQueue
from tetris.control.elastic import ElasticConfig, ExchangeModel
from tetris.scheduler.decode_latency import LLAMA3_8B, DecodeLatencyModel
from tetris.scheduler.policies import make_policy
from tetris.sim.cluster import cluster_by_name
from tetris.sim.elastic import ShardedDecodeRequest, ShardedDecodeSim
from tetris.sim.elastic_runs import _DecodeSide, _placer, run_elastic, with_tail
from tetris.sim.experiments import RunSpec, _profile, make_requests, run_one
from tetris.sim.workload import SimRequest

STEP = DecodeLatencyModel(LLAMA3_8B).step_time
EXCHANGE = ExchangeModel(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)


def test_off_the_cluster_run_equals_the_plain_simulator():
    spec = RunSpec(model="8b", workload="long", rate=0.5, requests=60, improvement_rate=0.3)
    plain, _ = run_one(spec)
    elastic, sim = run_elastic(spec, ElasticConfig(enabled=False))
    assert elastic.ttft_s == plain.ttft_s
    assert elastic.tbt == plain.tbt and elastic.throughput_rps == plain.throughput_rps
    assert all(not r.remote for r in sim.decode_reqs)


def test_holders_hold_and_the_master_steps_with_them():
    master, holder = (ShardedDecodeSim(i, 8, 4_000_000, 256, STEP, EXCHANGE.step_time)
                      for i in range(2))
    holder.used_tokens = holder.context_tokens = 1_500_000   # a busy holder
    req = ShardedDecodeRequest("r", 0, 1_000_000, 11, 0.0, master_tokens=400_011)
    req.remote = [(holder, 600_000)]
    master.enqueue(req)
    assert holder.used_tokens == 2_100_000 and holder.held == {}
    end = master.start_step(0.0)
    assert holder.held == {"r": 600_000} and holder.context_tokens == 2_100_000
    assert master.context_tokens == 400_001              # its range: prompt part + first token
    # the idle holder reads its 2.1M tokens; longer than the master's own 400K-token step
    holder_part = STEP(8, 1, 2_100_000) - STEP(8, 1, 0)
    assert holder_part > STEP(8, 1, 400_001)
    assert end == pytest.approx(holder_part + EXCHANGE.step_time(2))
    for _ in range(10):
        master.finish_step(end)
        end = master.start_step(end)
    assert end is None and req.finish_time > 0
    assert holder.held == {} and holder.used_tokens == holder.context_tokens == 1_500_000
    assert master.used_tokens == master.context_tokens == 0


@pytest.mark.parametrize("enabled", [False, True])
def test_a_1m_tail_on_the_70b_cluster(enabled):
    cluster = cluster_by_name("70b")
    cap = cluster.kv_capacity_tokens(cluster.decode_tp)
    assert cap < 1_000_000 < 4 * cap                     # 448K tokens per TP-4 instance
    reqs = with_tail(make_requests("long", 0.5, 60, 0), 20, 1_000_000)
    placer, step = _placer(cluster, ElasticConfig(enabled=enabled))
    policy = make_policy("fixed-sp-8", _profile(cluster), sp_candidates=cluster.sp_candidates)
    control = ControlPlane(policy, PrefillQueue(cluster.node_of()), placer.router,
                           improvement_rate=0.0)
    sim = _DecodeSide(reqs, placer=placer, cluster=cluster, control=control,
                      latency=_profile(cluster), decode_step=step)
    sim.run()
    tails = [r.request_id for r in reqs if r.prompt_tokens == 1_000_000]
    assert len(tails) == 3
    if not enabled:
        assert sim.refused == tails
    else:
        assert sim.refused == []
        for r in sim.decode_reqs:
            if r is not None and r.request_id in tails:
                assert r.group_size >= 3 and r.finish_time > r.admit_time
    served = [r for r in sim.decode_reqs if r is not None]
    assert len(served) == 60 - len(sim.refused)
    assert all(r.finish_time == r.finish_time for r in served)   # every one finished (not NaN)
    assert all(d.used_tokens == 0 and d.context_tokens == 0 and not d.held for d in sim.decoders)
    assert placer.router.virtual == [0] * 8 and placer.groups == {}


def _decode_side(model, requests, config):
    cluster = cluster_by_name(model)
    placer, step = _placer(cluster, config)
    policy = make_policy("fixed-sp-8", _profile(cluster), sp_candidates=cluster.sp_candidates)
    control = ControlPlane(policy, PrefillQueue(cluster.node_of()), placer.router,
                           improvement_rate=0.0)
    sim = _DecodeSide(requests, placer=placer, cluster=cluster, control=control,
                      latency=_profile(cluster), decode_step=step)
    sim.run()
    return sim, placer


def test_a_range_moves_onto_its_master_once_others_finish():
    reqs = [SimRequest("a", 0.0, 3_500_000, 2),        # instance 0, done after one step
            SimRequest("b", 0.001, 3_500_000, 2_000),  # instance 1
            SimRequest("c", 0.002, 1_200_000, 3_000)]  # fits neither: 0 (master) and 1
    sim, placer = _decode_side("8b", reqs, ElasticConfig(enabled=True, spread_for_time=False))
    c = sim.decode_reqs[2]
    assert sim.consolidations == 1 and c.remote == [] and c.finish_time > 0
    # a's step, then c's first with 1's range: c's next step pays the copy of that range
    held = sim.groups["c"].tokens_on(1)                  # the range placed on instance 1
    assert sim.groups["c"].master == 0 and 500_000 < held < 700_000
    assert c.kv_tokens == 1_203_000                      # all of c's KV on the master at the end
    copy = placer.exchange.kv_move_time(held)            # 128 KiB a token at 200 GB/s
    assert copy == pytest.approx(held * 131_072 / 200e9)
    assert max(sim.decoders[0].step_durations) > copy    # the step that paid for it
    assert all(d.used_tokens == 0 and not d.held for d in sim.decoders)
    assert placer.router.virtual == [0, 0] and placer.groups == {}


def test_on_the_cluster_run_spreads_the_tail_and_frees_everything():
    spec = RunSpec(model="8b", workload="long", rate=0.5, requests=40, improvement_rate=0.3)
    reqs = with_tail(make_requests("long", 0.5, 40, 0), 10, 1_000_000)
    res, sim = run_elastic(spec, ElasticConfig(enabled=True), reqs)
    sharded = {r.request_id for r in sim.decode_reqs if r.remote}
    tails = {r.request_id for r in reqs if r.prompt_tokens == 1_000_000}
    assert sharded and sharded <= tails                  # the long ones spread, onto idle instances
    assert all(sim.groups[rid].sharded for rid in sharded)
    assert all(r.finish_time == r.finish_time for r in sim.decode_reqs)
    assert all(d.used_tokens == 0 and not d.held for d in sim.decoders)
    assert sim.control.held()["virtual_usage"] == 0 and sim.placer.groups == {}
    plain, _ = run_one(spec, reqs)
    assert res.ttft_s == plain.ttft_s                    # the prefill side is untouched
