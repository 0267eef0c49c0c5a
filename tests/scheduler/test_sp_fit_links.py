"""Layout deltas against the ring on the links Eq. 1 was fitted on (issue #26's bug: a NIC
slower than the profile's made chunks faster, and ``tetris plan`` at 2 GB/s printed a negative
end time)."""

from __future__ import annotations

import json

import pytest

from tetris.cli.main import main
from tetris.config import SpLayoutConfig
from tetris.scheduler.latency import load_profile
from tetris.scheduler.layout_policy import (
    assign_layouts,
    attention_seconds,
    chunk_seconds,
    needs_layout_choice,
)
from tetris.scheduler.policies import make_policy
from tetris.scheduler.pool import PoolState
from tetris.scheduler.sp_comm import LLAMA3_8B, LayoutChooser

PROFILE = load_profile("a100-llama3-8b-tp1")
NODE_OF = [0] * 8 + [1] * 8
# (group, history, chunk): one node, two nodes, short chunks after long history (where the
# cost model's fitted ring exceeds Eq. 1 itself) and long chunks
GROUPS = [tuple(range(2)), (7, 8), tuple(range(4)), (6, 7, 8, 9), tuple(range(8)),
          tuple(range(4, 12)), tuple(range(16))]
SHAPES = [(0, 512), (0, 8192), (4096, 2048), (32768, 16384), (131072, 64), (131072, 8192),
          (500000, 512), (1000000, 32768)]
LAYOUTS = [("ring",), ("ring", "a2a"), ("ring", "sptp"), ("ring", "a2a", "sptp")]
GBPS = [100.0, 25.0, 10.0, 5.0, 2.0, 1.0]   # slower and slower


def _predicted(cfg: SpLayoutConfig, group, history, tokens):
    """The chunk's compute and its predicted seconds under the chosen layout, and every
    considered layout's (``x`` or ``x/M``) predicted seconds."""
    chooser = LayoutChooser.from_config(cfg, LLAMA3_8B)
    sp = len(group)
    pick = chooser.choose(group, NODE_OF, history, tokens,
                          attention_seconds(PROFILE, sp, history, tokens))
    eq1 = PROFILE.predict(sp, history, tokens)
    compute, delta = chunk_seconds(eq1, pick)
    each = {x: compute + t for x, t in pick.times.items()}
    return compute, eq1 + delta, each


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("layouts", LAYOUTS)
def test_a_slower_link_never_makes_a_chunk_faster(layouts, overlap):
    """For ring, a2a, sptp and the pipelined ring/M and a2a/M, every considered layout's time
    and the chosen one's are non-increasing in the inter-node (and intra-node) bandwidth, never
    below the chunk's compute-only part, and positive."""
    checked = 0
    for group in GROUPS:
        for h, l in SHAPES:
            prev = None
            for gbps in GBPS:
                now = {}
                for intra in (240.0, 60.0):   # the intra-node link slowed too
                    cfg = SpLayoutConfig(layouts=layouts, inter_node_gbps=gbps,
                                         intra_node_gbps=intra, ring_overlap=overlap,
                                         micro_partitions=(1, 2, 4, 8))
                    compute, chosen, each = _predicted(cfg, group, h, l)
                    assert compute >= 0 and chosen > 0
                    assert chosen >= compute and min(each.values()) == pytest.approx(chosen)
                    assert all(t >= compute for t in each.values())
                    now[intra] = (chosen, each)
                    checked += 1
                assert now[60.0][0] >= now[240.0][0]
                if prev is not None:
                    assert now[240.0][0] >= prev[0], (group, h, l, gbps)
                    for x, t in now[240.0][1].items():
                        assert t >= prev[1][x], (x, group, h, l, gbps)
                prev = now[240.0]
    assert checked == len(GROUPS) * len(SHAPES) * len(GBPS) * 2


def test_on_the_fitted_links_deltas_are_the_old_ones_bit_for_bit():
    """Deployment links = fitted links (the shipped configs): the delta is the layout's
    exposed seconds minus the ring's at the same links, exactly as before the fix, wherever
    Eq. 1 holds the modelled ring; and a ring-only deployment plans the search's own plan."""
    same = 0
    for layouts in LAYOUTS:
        for micro in ((1,), (1, 2, 4, 8)):
            for overlap in (True, False):
                cfg = SpLayoutConfig(layouts=layouts, micro_partitions=micro,
                                     ring_overlap=overlap)
                chooser = LayoutChooser.from_config(cfg, LLAMA3_8B)
                for group in GROUPS:
                    for h, l in SHAPES:
                        sp = len(group)
                        pick = chooser.choose(group, NODE_OF, h, l,
                                              attention_seconds(PROFILE, sp, h, l))
                        key = (pick.layout if pick.micro_partitions == 1
                               else f"{pick.layout}/{pick.micro_partitions}")
                        old = pick.times[key] - pick.times["ring"]
                        assert pick.delta_s == old and pick.ring_fit_s == pick.times["ring"]
                        eq1 = PROFILE.predict(sp, h, l)
                        if pick.ring_fit_s <= eq1:
                            assert chunk_seconds(eq1, pick)[1] == old
                            same += 1
    assert same > 0
    assert not needs_layout_choice(SpLayoutConfig())
    chooser = LayoutChooser.from_config(SpLayoutConfig(), LLAMA3_8B)
    assert chooser.ring_only
    pool = PoolState([0.31] * 8 + [0.0] * 8, NODE_OF)
    plan = make_policy("tetris", PROFILE).plan("r", 131072, 0.0, pool)
    assert assign_layouts(plan, chooser, pool, 0.0, PROFILE) is plan


def test_eq1_holds_at_most_its_own_time_of_ring():
    """A 64-token chunk after 128k tokens on two nodes: the cost model's ring on the fitted
    25 GB/s exceeds Eq. 1, so the compute is 0 and the chunk takes its layout's own seconds
    (before: all-to-all's delta made it negative on the fitted links themselves)."""
    cfg = SpLayoutConfig(layouts=("ring", "a2a"))
    chooser = LayoutChooser.from_config(cfg, LLAMA3_8B)
    pick = chooser.choose((7, 8), NODE_OF, 131072, 64, attention_seconds(PROFILE, 2, 131072, 64))
    eq1 = PROFILE.predict(2, 131072, 64)
    assert pick.ring_fit_s > eq1 and pick.layout == "a2a"
    assert eq1 + pick.delta_s < 0   # the unheld delta: what the plan used to say
    compute, delta = chunk_seconds(eq1, pick)
    assert compute == 0.0 and eq1 + delta == pytest.approx(pick.comm_s) and pick.comm_s > 0


def test_a_ring_only_deployment_on_a_slower_nic_pays_for_it():
    """Ring only, 5 GB/s: the chooser is no longer the identity; the two-node chunk ends later
    than Eq. 1 says, the one-node chunk as Eq. 1 says."""
    cfg = SpLayoutConfig(inter_node_gbps=5.0, ring_overlap=False)
    assert needs_layout_choice(cfg)
    chooser = LayoutChooser.from_config(cfg, LLAMA3_8B)
    assert not chooser.ring_only
    pool = PoolState([0.31] * 8 + [0.0] * 8, NODE_OF)
    plan = make_policy("tetris", PROFILE).plan("r", 131072, 0.0, pool)
    out = assign_layouts(plan, chooser, pool, 0.0, PROFILE).validate(16)
    assert [c.sp_layout for c in out.chunks] == ["ring"] * len(out.chunks)
    for c in out.chunks:
        eq1 = PROFILE.predict(c.sp_size, c.start, c.tokens)
        spans = len({NODE_OF[i] for i in c.instances}) > 1
        assert (c.sp_layout_delta_s > 0) == spans
        assert c.expected_end - c.expected_start == pytest.approx(eq1 + c.sp_layout_delta_s)
    assert out.ttft_estimate > plan.ttft_estimate


def _plan_json(capsys, gbps: str) -> dict:
    assert main(["plan", "--pool", "16", "--node-size", "8", "--prompt-tokens", "131072",
                 "--sp-layouts", "ring,a2a,sptp", "--inter-node-gbps", gbps, "--queue-times",
                 ",".join(["0.31"] * 8 + ["0"] * 8), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tetris_plan_at_2_gbps_prints_positive_increasing_end_times(capsys):
    """The issue's example: before, the SP 16 chunk ended at −2.645 s."""
    slow, shipped = _plan_json(capsys, "2"), _plan_json(capsys, "25")
    ends = [c["expected_end"] for c in slow["chunks"]]
    starts = [c["expected_start"] for c in slow["chunks"]]
    assert len(ends) == 2 and all(e > s >= 0 for s, e in zip(starts, ends))
    assert ends == sorted(ends) and slow["ttft_estimate"] == ends[-1]
    assert slow["ttft_estimate"] > shipped["ttft_estimate"] > 0
