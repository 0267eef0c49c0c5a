"""SP-TP on TP > 1 instances in the layout cost model (tetris/scheduler/sp_comm.py): each head
slice gathers and reduces the model's whole rows (``model_hidden``), so SP-TP's volume per
slice is the TP-1 one while the ring's shrinks with the slice, and the chooser's crossover
against the ring moves accordingly; a TP-2 deployment's chooser may pick SP-TP."""

from __future__ import annotations

import msgspec
import pytest

from tetris.config import SpLayoutConfig, load_deployment
from tetris.scheduler.sp_comm import (
    LLAMA3_8B,
    CommLinks,
    LayoutChooser,
    ModelGeometry,
    layout_volume,
)

FLAT = CommLinks(intra_node=100e9, inter_node=100e9, message_latency_s=0.0)


def test_a_tp_instance_geometry_keeps_the_model_width():
    g = LLAMA3_8B.per_instance(2)
    assert (g.num_heads, g.num_kv_heads, g.tp_size) == (16, 4, 2)
    assert (g.hidden, g.model_hidden) == (2048, 4096)
    assert LLAMA3_8B.model_hidden == LLAMA3_8B.hidden == 4096
    tiny = load_deployment("tiny-cpu.toml").model
    assert ModelGeometry.from_model_config(tiny, 2) == ModelGeometry(4, 4, 1, 32, 2)


@pytest.mark.parametrize("n,h", [(2, 0), (4, 0), (4, 3000), (8, 5000)])
def test_sptp_volume_per_slice_is_whole_rows_plus_the_slice_history(n, h):
    g, lin = LLAMA3_8B.per_instance(2), 1024
    hist = (n - 1) / n * h * 2 * max(4, n) * 128          # the slice's 4 KV heads
    assert layout_volume("sptp", g, n, h, lin) == pytest.approx(2 * lin * 4096 * (n - 1) + hist)
    if h == 0:   # the rows are the model's: the TP-1 volume on every slice
        assert layout_volume("sptp", g, n, 0, lin) == layout_volume("sptp", LLAMA3_8B, n, 0, lin)
    # the ring's block is the slice's KV heads: half the TP-1 one
    assert layout_volume("ring", g, n, h, lin) == layout_volume("ring", LLAMA3_8B, n, h, lin) / 2


def test_the_chooser_picks_sptp_past_the_crossover_of_whole_rows():
    """8B at TP 2, 4 members on one node, flat links, no overlap. Per layer, in units of
    (N−1)·b/B: ring (h+l)/4·2·4·128 = 256(h+l); SP-TP 2·l/4·4096 + h/4·(2·4/4)·128 = 2048·l +
    64·h. SP-TP is cheaper iff h > 1792/192·l ≈ 9.33·l (with the slice's 2048-wide rows it
    would be h > 4·l)."""
    g = LLAMA3_8B.per_instance(2)
    chooser = LayoutChooser(("ring", "sptp"), g, FLAT, ring_overlap=False)
    group, node_of, lin = (0, 1, 2, 3), (0, 0, 0, 0), 1000
    picks = {h: chooser.choose(group, node_of, h, lin).layout for h in (6000, 9300, 9400, 20000)}
    assert picks == {6000: "ring", 9300: "ring", 9400: "sptp", 20000: "sptp"}
    t = chooser.choose(group, node_of, 20000, lin).times
    unit = g.num_layers * 3 * 2 / 100e9            # layers · (N−1) · bytes per element / B
    assert t["ring"] == pytest.approx(256 * (20000 + lin) * unit)
    assert t["sptp"] == pytest.approx((2048 * lin + 64 * 20000) * unit)


def test_a_tp2_deployment_plans_sptp_chunks():
    from tetris.scheduler.latency import load_profile
    from tetris.scheduler.layout_policy import with_layout_choice
    from tetris.scheduler.policies import make_policy
    from tetris.scheduler.pool import PoolState

    dep = load_deployment("tiny-cpu.toml")
    dep = msgspec.structs.replace(
        dep, prefill=msgspec.structs.replace(dep.prefill, tp_size=2),
        sp_layout=SpLayoutConfig(layouts=("ring", "sptp"), ring_overlap=False))
    wrapped = with_layout_choice(make_policy("fixed-sp-4", load_profile("a100-llama3-8b-tp1")),
                                 dep)
    assert wrapped.chooser.geometry == ModelGeometry(4, 4, 1, 32, 2)
    pool = PoolState([0.0] * 4, [0, 0, 1, 1])
    short = wrapped.chooser.choose((0, 1, 2, 3), (0, 0, 1, 1), 60000, 16)
    assert short.layout == "sptp" and "sptp" in short.reason
    (c,) = wrapped.plan("r", 4096, 0.0, pool).chunks   # h = 0: the ring moves less
    assert c.sp_layout == "ring"
