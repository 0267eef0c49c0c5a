"""SP-TP in the layout cost model (tetris/scheduler/sp_comm.py): its executable volume, the
Appendix A SP-NTP vs SP-TP rule as the chooser applies it, and SP 16 over 8 KV heads."""

from __future__ import annotations

import pytest

from tetris.config import SpLayoutConfig
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


@pytest.mark.parametrize("n,h", [(2, 0), (4, 0), (4, 3000), (16, 5000)])
def test_sptp_volume_is_appendix_a_plus_the_history_kv(n, h):
    g, lin = LLAMA3_8B, 4096
    history = (n - 1) / n * h * 2 * max(g.num_kv_heads, n) * g.head_dim
    assert layout_volume("sptp", g, n, h, lin) == pytest.approx(
        2 * lin * g.hidden * (n - 1) + history)
    if h == 0:
        assert layout_volume("sptp", g, n, 0, lin) == layout_volume("allgather", g, n, 0, lin)
    # one node, one link, no latency: the time is the volume over the group's N links
    t = layout_time("sptp", g._replace(num_layers=1), FLAT, [n], h, lin)
    assert t == pytest.approx(layout_volume("sptp", g, n, h, lin) * 2 / n / 100e9)


@pytest.mark.parametrize("n", [4, 8])
def test_appendix_a_rule_sp_ntp_beats_sp_tp_above_2dN_over_N_minus_2(n):
    """SP-NTP on a TP deployment (parameter all-gather 4d²(N−1)) vs SP-TP, MHA, h = 0: SP-NTP
    is cheaper iff L > 2dN/(N−2) (1024·2·4/2 = 4096 at N = 4; 2730.7 at N = 8)."""
    chooser = LayoutChooser(("ring", "a2a", "sptp"), MHA, FLAT, ntp_gathers_weights=True)
    group, node_of = tuple(range(n)), (0,) * n
    crossover = 2 * MHA.hidden * n / (n - 2)
    below = chooser.choose(group, node_of, 0, int(crossover) - 64)
    above = chooser.choose(group, node_of, 0, int(crossover) + 64)
    assert below.times["sptp"] < below.times["a2a"] and below.layout != "a2a"
    assert above.times["a2a"] < above.times["sptp"] and above.layout == "a2a"
    # without the weight gather (members holding whole weights) SP-NTP wins at any L
    plain = LayoutChooser(("ring", "a2a", "sptp"), MHA, FLAT)
    assert plain.choose(group, node_of, 0, int(crossover) - 64).layout == "a2a"


def test_appendix_a_rule_never_picks_sp_ntp_at_two_members():
    """The erratum: the paper's text says SP-NTP always wins at N = 2; its formula
    (L > 2dN/(N−2), infinite at N = 2) says never, by 4d² per layer. The model follows the
    formula."""
    chooser = LayoutChooser(("ring", "a2a", "sptp"), MHA, FLAT, ntp_gathers_weights=True)
    for lin in (1024, 65536, 1 << 20):
        t = chooser.choose((0, 1), (0, 0), 0, lin).times
        weights = 4 * MHA.hidden ** 2 * (2 - 1) / 2 * 2 / 100e9   # 4d²(N−1) over N links, bf16
        assert t["a2a"] - t["sptp"] == pytest.approx(weights, rel=1e-9)
        assert chooser.choose((0, 1), (0, 0), 0, lin).layout != "a2a"


def test_sp16_over_8_kv_heads_replicates_them_for_a2a_and_sptp():
    """LLaMA3-8B, 16 members on 2 nodes, ring charged in full: both head-sharded layouts run
    with each KV head on 2 members (R = 16 KV heads travel); with a long history the ring's NIC
    hop is dearest, SP-NTP cheapest, SP-TP (rails across the nodes) in between."""
    g, n, h, lin = LLAMA3_8B, 16, 131072, 8192
    assert layout_volume("a2a", g, n, h, lin) == pytest.approx(
        (n - 1) / n * (2 * lin * g.num_heads * g.head_dim + 2 * (h + lin) * 16 * g.head_dim))
    links = CommLinks.from_config(SpLayoutConfig())
    group, node_of = tuple(range(16)), (0,) * 8 + (1,) * 8
    every = LayoutChooser(("ring", "a2a", "sptp"), g, links, ring_overlap=False)
    pick = every.choose(group, node_of, h, lin)
    assert pick.layout == "a2a" and "out" not in pick.reason
    assert pick.times["a2a"] < pick.times["sptp"] < pick.times["ring"]
    no_a2a = LayoutChooser(("ring", "sptp"), g, links, ring_overlap=False)
    assert no_a2a.choose(group, node_of, h, lin).layout == "sptp"
    # no history, across the two nodes: SP-TP's rails put 1/8 of its rows on each NIC and beat
    # the ring's NIC hop; SP-NTP is cheaper still (from N = 5 on at any h)
    assert no_a2a.choose(group, node_of, 0, lin).layout == "sptp"
    assert every.choose(group, node_of, 0, lin).layout == "a2a"
    # inside one node SP-TP's 2·d per token loses to the ring's 2·Hkv·d_h
    assert no_a2a.choose(group, (0,) * 16, 0, lin).layout == "ring"
    assert "cannot split" in every.feasible("sptp", 3) and "cannot split" in every.feasible("a2a", 12)


def test_config_accepts_sptp():
    assert SpLayoutConfig(layouts=("ring", "a2a", "sptp")).layouts[-1] == "sptp"
    with pytest.raises(ValueError, match="may add 'a2a', 'sptp'"):
        SpLayoutConfig(layouts=("ring", "tree"))


def test_sptp_across_nodes_is_timed_as_the_hierarchical_collectives():
    """No history, no latency. Two nodes of 8 run rails: per collective one row set over each
    member's NIC, then 2 row sets to each of 7 node peers; G = 8 times less NIC time than flat,
    where every member sends its rows to the 8 members of the other node. Nodes of 8 and 4 run
    one leader per node (7 intra sends, the leader's bundle of 8 over its NIC, 7 forwards of
    the other node's 4), which saves inter-node bytes but, with one NIC per GPU, not time."""
    links = CommLinks(intra_node=240e9, inter_node=25e9, message_latency_s=0.0)
    g, lin = LLAMA3_8B._replace(num_layers=1), 8192
    rows = lin / 16 * g.hidden * 2
    rails = rows / 25e9 + 7 * 2 * rows / 240e9
    assert layout_time("sptp", g, links, [8, 8], 0, lin) == pytest.approx(2 * rails, rel=1e-12)
    flat = 2 * max(7 * rows / 240e9, 8 * rows / 25e9)
    assert layout_time("sptp", g, links, [8, 8], 0, lin) < flat / 3
    rows = lin / 12 * g.hidden * 2
    leader = 7 * rows / 240e9 + 8 * rows / 25e9 + 7 * 4 * rows / 240e9
    assert layout_time("sptp", g, links, [8, 4], 0, lin) == pytest.approx(2 * leader, rel=1e-12)
    assert layout_time("sptp", g, links, [8, 4], 0, lin) > 2 * max(7 * rows / 240e9,
                                                                   8 * rows / 25e9)
