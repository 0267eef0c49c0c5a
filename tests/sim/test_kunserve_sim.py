"""SIMULATION of KunServe and the KV-centric baselines on the paper's 14B TP-1 pool."""

import msgspec
import pytest

from tetris.control.drop_plan import Group, group_kv_blocks, split_layers
from tetris.sim.kunserve import KunServeSim
from tetris.sim.kunserve_workload import burst_trace, load_profile, profile_path

N, RATE = 6000, 160.0   # the rate doubles for requests 2400-5400: ~19 s of burst


@pytest.fixture(scope="module")
def results():
    mem, prof = load_profile(profile_path("qwen2.5-14b-tp1"))
    out = {}
    for policy in ("queue", "recompute", "swap", "kunserve"):
        sim = KunServeSim(burst_trace(N, RATE, seed=3, burst_at=0.4, burst_end=0.9), mem, prof,
                          policy)
        out[policy] = (sim, sim.run())
    return mem, out


def test_every_request_finishes_with_its_tokens_under_every_policy(results):
    _, out = results
    for policy, (sim, res) in out.items():
        assert res["unfinished"] == 0, policy
        assert all(r.generated == r.output for r in sim.reqs), policy
        assert all(u.used == 0 and not u.running for u in sim.units), policy


def test_baselines_behave_as_their_mechanisms(results):
    _, out = results
    assert out["queue"][1]["preemptions"] == 0            # reserved up front
    assert out["recompute"][1]["preemptions"] > 0
    assert out["swap"][1]["preemptions"] > 0
    for policy in ("queue", "recompute", "swap"):
        assert out[policy][1]["drops"] == 0


def test_kunserve_drops_in_the_burst_restores_after_and_cuts_the_tail(results):
    mem, out = results
    sim, res = out["kunserve"]
    assert res["drops"] >= 1 and res["restores"] >= 1 and res["refusals"] == 0
    # Every restore came back: the pool ends as 8 undropped instances.
    assert [u.members for u in sim.units] == [(i,) for i in range(8)]
    assert sim.kv_capacity_log[-1][1] == 8 * mem.kv_blocks
    assert max(c for _, c in sim.kv_capacity_log) > 8 * mem.kv_blocks
    for policy in ("queue", "recompute", "swap"):
        assert out[policy][1]["p99_ttft"] >= 5 * res["p99_ttft"], policy
        assert res["p50_tpot"] <= 1.35 * out[policy][1]["p50_tpot"], policy


def test_group_capacity_in_the_simulator_is_the_control_planes(results):
    mem, _ = results
    _, prof = load_profile(profile_path("qwen2.5-14b-tp1"))
    prof = msgspec.structs.replace(prof, instances=2)
    sim = KunServeSim(burst_trace(10, 1.0, seed=0), mem, prof, "kunserve")
    sim.control.groups = [Group((0, 1), split_layers(48, 2))]
    sim._regroup(0.0, [(0, 1)])
    assert [u.capacity for u in sim.units] == [group_kv_blocks(mem, sim.control.groups[0])]
