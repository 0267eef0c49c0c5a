"""The SP layout cost model (CSPS Appendix A) and the per-chunk chooser."""

from __future__ import annotations

import json

import msgspec
import pytest

from tetris.cli.main import main
from tetris.config import SpLayoutConfig
from tetris.scheduler.latency import load_profile
from tetris.scheduler.layout_policy import (
    LayoutPolicy,
    assign_layouts,
    attention_seconds,
)
from tetris.scheduler.policies import make_policy
from tetris.scheduler.pool import PoolState
from tetris.scheduler.sp_comm import (
    LLAMA3_8B,
    CommLinks,
    LayoutChooser,
    ModelGeometry,
    layout_time,
    layout_volume,
)

MHA = ModelGeometry(num_layers=1, num_heads=16, num_kv_heads=16, head_dim=64)   # d = 1024
FLAT = CommLinks(intra_node=100e9, inter_node=100e9, message_latency_s=0.0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_volumes_are_appendix_a_at_no_history(n):
    d, lin = MHA.hidden, 4096
    assert layout_volume("a2a", MHA, n, 0, lin) == pytest.approx(4 * lin * d * (n - 1) / n)
    assert layout_volume("allgather", MHA, n, 0, lin) == 2 * lin * d * (n - 1)
    # the ring forwards every member's KV (K and V: 2·d per token with MHA) N-1 times
    assert layout_volume("ring", MHA, n, 0, lin) == (n - 1) * lin * 2 * d


@pytest.mark.parametrize("n,l,crossover", [
    (2, 1024, 3072),       # l·Hq = (h+l)·Hkv·(N−1): h* = l·(Hq/(Hkv·(N−1)) − 1) = 3l at N = 2
    (4, 1536, 512),        # h* = l/3 at N = 4
])
def test_chooser_picks_a2a_above_and_ring_below_the_crossover(n, l, crossover):
    """One node, one bandwidth, no latency: times are volumes over one bandwidth, so the
    layouts cross where LLaMA3-8B's V_a2a = V_ring (Hq/Hkv = 4), worked out by hand above."""
    chooser = LayoutChooser(("ring", "a2a"), LLAMA3_8B, FLAT)
    group, node_of = tuple(range(n)), (0,) * n
    below = chooser.choose(group, node_of, crossover - 64, l)
    above = chooser.choose(group, node_of, crossover + 64, l)
    assert below.layout == "ring" and below.delta_s == 0.0
    assert above.layout == "a2a" and above.delta_s < 0
    at = chooser.choose(group, node_of, crossover, l).times
    assert at["a2a"] == pytest.approx(at["ring"], rel=1e-12)


def test_a_slow_inter_node_link_moves_the_crossover():
    """Four instances at h = 0, l = 1536: inside one node the ring moves less (below h* = l/3).
    Split 2 + 2 over nodes with a 10x slower NIC, the ring's every step crosses it, while each
    all-to-all member sends 2 of its 3 messages over it: 2·(2lHq + 2lHkv)/16 < 3·2lHkv/4 holds
    for Hq/Hkv = 4, so all-to-all wins."""
    links = CommLinks(intra_node=250e9, inter_node=25e9, message_latency_s=0.0)
    chooser = LayoutChooser(("ring", "a2a"), LLAMA3_8B, links)
    assert chooser.choose((0, 1, 2, 3), (0,) * 8, 0, 1536).layout == "ring"
    split = chooser.choose((0, 1, 4, 5), (0, 0, 0, 0, 1, 1, 1, 1), 0, 1536)
    assert split.layout == "a2a"
    assert split.times["ring"] == pytest.approx(32 * 3 * (1536 / 4 * 2 * 8 * 128 * 2) / 25e9)


def test_groups_that_cannot_split_the_heads_stay_on_the_ring():
    """12 members cannot split 32 heads (16 can: KV heads replicated, test_sp_comm_sptp.py)."""
    chooser = LayoutChooser(("ring", "a2a"), LLAMA3_8B, FLAT)
    pick = chooser.choose(tuple(range(12)), (0,) * 16, 100_000, 1024)
    assert pick.times["a2a"] < pick.times["ring"]
    assert pick.layout == "ring" and "group of 12 cannot split 32 heads over 8 KV heads" in pick.reason


def test_ring_transfers_hide_behind_attention():
    g = LLAMA3_8B
    block = layout_time("ring", g, FLAT, [4], 4000, 1000)
    assert layout_time("ring", g, FLAT, [4], 4000, 1000, attention_s=1e9) == 0.0
    per_step = block / (g.num_layers * 3)
    half = layout_time("ring", g, FLAT, [4], 4000, 1000, attention_s=per_step * g.num_layers * 2)
    assert half == pytest.approx(block / 2)


def _pool():
    return PoolState([0.0] * 8 + [0.31] * 8, [0] * 8 + [1] * 8)


def test_ring_only_plans_are_the_search_s_own():
    prof = load_profile("a100-llama3-8b-tp1")
    policy = make_policy("tetris", prof)
    ring = LayoutChooser(SpLayoutConfig().layouts, LLAMA3_8B, CommLinks.from_config(SpLayoutConfig()))
    plan = policy.plan("r", 131072, 0.0, _pool())
    assert LayoutPolicy(policy, ring, prof).plan("r", 131072, 0.0, _pool()) == plan
    assert assign_layouts(plan, ring, _pool(), 0.0, prof) is plan


def test_a2a_chunks_are_timed_with_their_layout():
    """A slow NIC makes all-to-all pay on the chunk spanning nodes; each chunk then takes
    Eq. 1 plus its layout's delta and starts when the previous one ends (Eq. 2). The delta is
    against the ring on the links Eq. 1 was fitted on (25 GB/s), so a NIC slower than those
    makes the chunk slower than Eq. 1 (before: 2.89 s *before* it started)."""
    prof = load_profile("a100-llama3-8b-tp1")
    cfg = SpLayoutConfig(layouts=("ring", "a2a"), inter_node_gbps=1.0)
    chooser = LayoutChooser.from_config(cfg, LLAMA3_8B)
    pool = PoolState([0.0] * 16, [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4)
    base = make_policy("fixed-sp-8", prof).plan("r", 65536, 0.0, pool)
    plan = assign_layouts(base, chooser, pool, 0.0, prof).validate(16)
    (c,) = plan.chunks
    assert c.sp_layout == "a2a" and "a2a" in c.sp_layout_reason
    pick = chooser.choose(c.instances, pool.node_of, 0, 65536,
                          attention_seconds(prof, 8, 0, 65536))
    assert pick.delta_s == pick.comm_s - pick.ring_fit_s and pick.comm_s == pick.times["a2a"]
    assert pick.comm_s > pick.ring_fit_s   # a2a on 1 GB/s dearer than the ring on 25 GB/s
    assert c.expected_end == pytest.approx(prof.predict(8, 0, 65536) + pick.delta_s)
    assert plan.ttft_estimate == pytest.approx(c.expected_end)


def test_tetris_plan_shows_each_chunk_s_layout_and_why(capsys):
    rc = main(["plan", "--pool", "16", "--node-size", "4", "--prompt-tokens", "65536",
               "--policy", "fixed-sp-8", "--sp-layouts", "ring,a2a", "--inter-node-gbps", "1",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    (c,) = out["chunks"]
    assert c["sp_layout"] == "a2a" and c["sp_layout_reason"].startswith("comm ring ")
    rc = main(["plan", "--pool", "16", "--node-size", "4", "--prompt-tokens", "65536",
               "--policy", "fixed-sp-8"])
    text = capsys.readouterr().out
    assert rc == 0 and "layout" not in text   # ring only: the plan as before


def test_a_deployment_s_sp_layout_table_wraps_its_policy():
    from tetris.config import load_deployment
    from tetris.scheduler.layout_policy import with_layout_choice

    prof = load_profile("a100-llama3-8b-tp1")
    dep = load_deployment("tiny-cpu.toml")
    policy = make_policy("fixed-sp-2", prof)
    assert with_layout_choice(policy, dep) is policy
    wrapped = with_layout_choice(policy, msgspec.structs.replace(
        dep, sp_layout=SpLayoutConfig(layouts=("ring", "a2a"), ring_overlap=False)))
    plan = wrapped.plan("r", 4096, 0.0, PoolState([0.0] * 4, [0, 0, 1, 1]))
    assert wrapped.chooser.geometry == ModelGeometry(4, 8, 2, 32)   # the tiny model's
    # at h = 0 on 2 instances SP-NTP moves (2·Hq + 2·Hkv)/2 / (2·Hkv) = 2.5x the ring's bytes
    (c,) = plan.chunks
    assert c.sp_layout == "ring" and c.sp_layout_reason.startswith("comm ring ")
    t = wrapped.chooser.choose(c.instances, (0, 0, 1, 1), 0, 4096).times
    lat = 4 * 1e-5   # a message's latency per layer: one ring step, two all-to-alls
    assert t["a2a"] - 2 * lat == pytest.approx(2.5 * (t["ring"] - lat), rel=1e-9)
