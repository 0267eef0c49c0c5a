"""Three-phase pipelining priced (sp_pipeline.py) and the chooser's micro-partitions (#26)."""

from __future__ import annotations

import itertools
import json

import msgspec
import pytest

from tetris.cli.main import main
from tetris.config import SpLayoutConfig, load_deployment
from tetris.scheduler.latency import load_profile
from tetris.scheduler.layout_policy import assign_layouts, with_layout_choice
from tetris.scheduler.policies import make_policy
from tetris.scheduler.pool import PoolState
from tetris.scheduler.sp_comm import (
    LLAMA3_8B,
    CommLinks,
    LayoutChooser,
    layout_time,
    pipelined_time,
)
from tetris.scheduler.sp_pipeline import a2a_layer_s, ring_layer_s
from tetris.sim.prefill import PrefillPoolSim

NO_LATENCY = CommLinks(intra_node=100e9, inter_node=10e9, message_latency_s=0.0)
SECONDS = (0.0, 0.3, 1.0, 2.5, 7.0)


@pytest.mark.parametrize("micro", [1, 2, 3, 4, 8, 16])
def test_priced_layer_is_never_below_its_communication_or_attention(micro):
    """Over a grid of phase times (either resource dominant), both pipelined layers take at
    least their whole communication and their whole attention; M = 1 is the unpipelined layer."""
    for c1, a, c2, o in itertools.product(SECONDS, SECONDS, SECONDS, (0.0, 0.05)):
        t = a2a_layer_s(c1, a, c2, micro, o)
        assert t >= max(c1 + c2, a) - 1e-12
        assert t >= c1 / micro + a + c2 / micro - 1e-12   # the first piece's A2A #1 is not hidden
        if micro == 1:
            assert t == pytest.approx(c1 + a + c2, rel=1e-15)
    for steps, c, a, o in itertools.product((1, 3, 7), SECONDS, SECONDS, (0.0, 0.05)):
        t = ring_layer_s(steps, c, a, micro, o)
        assert t >= max(steps * c, (steps + 1) * a) - 1e-12
        if micro == 1:
            assert t == pytest.approx(steps * max(a, c) + a, rel=1e-15)


def test_many_free_pieces_approach_the_larger_of_communication_and_attention():
    """With no per-piece cost the overlap closes in on max(comm, attention) as 1/M."""
    for m in (10, 100, 1000):
        assert a2a_layer_s(4.0, 3.0, 2.0, m, 0.0) == pytest.approx(6.0 + 3.0 / m)
        assert a2a_layer_s(1.0, 3.0, 2.0, m, 0.0) == pytest.approx(3.0 + 3.0 / m)
        assert ring_layer_s(3, 2.0, 1.0, m, 0.0) == pytest.approx(6.0 + 1.0 / m)


@pytest.mark.parametrize("layout,sp,nodes", [("ring", 4, 1), ("ring", 8, 2), ("a2a", 4, 1),
                                              ("a2a", 8, 2)])
def test_one_piece_is_the_unpipelined_layout_time(layout, sp, nodes):
    links = CommLinks(240e9, 25e9)
    counts = [sp // nodes] * nodes
    for h, l, att in ((0, 4096, 0.0), (30000, 8192, 0.05), (120000, 2048, 2.0)):
        whole = layout_time(layout, LLAMA3_8B, links, counts, h, l,
                            att if layout == "ring" else 0.0)
        assert pipelined_time(layout, LLAMA3_8B, links, counts, h, l, att, 1, 1e-3) == \
            pytest.approx(whole, rel=1e-12, abs=1e-15)


def _ring_inputs(sp, history, tokens, attention_s):
    """One ring step's transfer C and attention A_step per layer, worked out by hand."""
    block = (history + tokens) / sp * 2 * LLAMA3_8B.num_kv_heads * LLAMA3_8B.head_dim * 2
    return block / NO_LATENCY.intra_node, attention_s / (LLAMA3_8B.num_layers * sp)


def test_ring_pieces_pay_below_the_overhead_crossover_and_not_above():
    """A transfer-bound ring of 4 (C = 2·A_step): two pieces save A_step/2 of the last step
    per layer and cost (s−1)·o, so M = 2 wins iff o < A_step / (2·(s−1))."""
    sp, h, l = 4, 60000, 4096
    c, _ = _ring_inputs(sp, h, l, 0.0)
    attention = c / 2 * LLAMA3_8B.num_layers * sp          # A_step = C/2
    o_star = (c / 2) / (2 * (sp - 1))
    group, node_of = tuple(range(sp)), (0,) * sp
    for o, want in ((0.9 * o_star, 2), (1.1 * o_star, 1)):
        chooser = LayoutChooser(("ring",), LLAMA3_8B, NO_LATENCY, micro_partitions=(1, 2),
                                piece_overhead_s=o)
        pick = chooser.choose(group, node_of, h, l, attention)
        assert (pick.layout, pick.micro_partitions) == ("ring", want), pick.reason
        assert pick.delta_s == pytest.approx(
            min(0.0, LLAMA3_8B.num_layers * ((sp - 1) * o - c / 4)), abs=1e-15)
    # more pieces when they are free and the ring is transfer-bound; none when attention hides it
    free = LayoutChooser(("ring",), LLAMA3_8B, NO_LATENCY, micro_partitions=(1, 2, 4, 8),
                         piece_overhead_s=0.0)
    assert free.choose(group, node_of, h, l, attention).micro_partitions == 8
    assert free.choose(group, node_of, h, l, 8 * attention).micro_partitions == 1


def test_a2a_pieces_pay_below_the_overhead_crossover_and_not_above():
    """All-to-all of 4 with its communication C1 + C2 above the layer's attention A: two pieces
    hide A/2 and cost two exchanges' overhead, so a2a/2 wins iff o < A/4 per layer."""
    sp, h, l = 4, 60000, 4096
    chooser0 = LayoutChooser(("ring", "a2a"), LLAMA3_8B, NO_LATENCY)
    comm = chooser0.choose(tuple(range(sp)), (0,) * sp, h, l).times["a2a"]
    attention = comm / 2                                  # A = (C1 + C2)/2 per layer
    o_star = attention / LLAMA3_8B.num_layers / 4
    for o, want in ((0.9 * o_star, 2), (1.1 * o_star, 1)):
        chooser = LayoutChooser(("a2a", "ring"), LLAMA3_8B, NO_LATENCY, ring_overlap=False,
                                micro_partitions=(1, 2), piece_overhead_s=o)
        pick = chooser.choose(tuple(range(sp)), (0,) * sp, h, l, attention)
        assert pick.layout == "a2a" and pick.micro_partitions == want, pick.reason
        assert pick.times["a2a/2"] - pick.times["a2a"] == pytest.approx(
            LLAMA3_8B.num_layers * (2 * o) - attention / 2, rel=1e-9)


def test_the_setting_is_off_by_default_and_plans_as_before():
    cfg = SpLayoutConfig()
    assert cfg.micro_partitions == (1,)
    with pytest.raises(ValueError, match="micro_partitions"):
        SpLayoutConfig(micro_partitions=(0, 2))
    chooser = LayoutChooser.from_config(SpLayoutConfig(layouts=("ring", "a2a")), LLAMA3_8B)
    pick = chooser.choose(tuple(range(8)), (0,) * 8, 100_000, 8192, 0.5)
    assert pick.micro_partitions == 1 and sorted(pick.times) == ["a2a", "ring"]
    assert "pieces" not in pick.reason
    dep = load_deployment(None)
    assert dep.sp_layout.micro_partitions == (1,)
    policy = object()
    assert with_layout_choice(policy, dep) is policy
    on = msgspec.structs.replace(dep, sp_layout=SpLayoutConfig(micro_partitions=(1, 2)))
    assert with_layout_choice(_Named(), on).chooser.micro_partitions == (1, 2)


class _Named:
    name, profile = "tetris", None


QUEUES = [0.31] * 8 + [0.0] * 8


def _plan_on_two_nodes(cfg: SpLayoutConfig):
    """The 8B A100 profile's plan for 128k tokens on 16 instances, half busy (as docs/csps.md):
    SP 8 on the free node, then SP 16 over both."""
    prof = load_profile("a100-llama3-8b-tp1")
    pool = PoolState.uniform(16, 8, QUEUES)
    plan = make_policy("tetris", prof).plan("p", 131072, 0.0, pool, 0.3)
    assert [c.sp_size for c in plan.chunks] == [8, 16]
    chooser = LayoutChooser.from_config(cfg, LLAMA3_8B)
    return assign_layouts(plan, chooser, pool, 0.0, prof).validate(16), prof


@pytest.mark.parametrize("layouts,want", [(("ring",), [("ring", 1), ("ring", 4)]),
                                          (("ring", "a2a"), [("ring", 1), ("a2a", 8)])])
def test_a_plan_with_pieces_runs_in_the_executors_and_in_the_simulator(layouts, want):
    """On a 5 GB/s NIC the two-node chunk is transfer-bound: the chooser pipelines it; the
    forced-plan parser and the executor's dispatch take the chunk as planned, and the
    simulator executes the plan to its predicted times (Eq. 1 + the pipelined delta)."""
    from tetris.actors.prefill.chunks import RunOptions, chunk_task
    from tetris.actors.prefill.group_attention import group_attention
    from tetris.actors.prefill.layout import (
        forced_plan,
        parse_plan_layouts,
        plan_layout,
    )
    from tetris.actors.prefill.world import PeerLink
    from tetris.actors.prefill.zigzag import normalize_ranges

    from tetris.token_ids import compact_tokens

    cfg = SpLayoutConfig(layouts=layouts, inter_node_gbps=5.0, micro_partitions=(1, 2, 4, 8))
    plan, prof = _plan_on_two_nodes(cfg)
    assert [(c.sp_layout, c.sp_micro_partitions) for c in plan.chunks] == want
    # a NIC slower than the 25 GB/s Eq. 1 was fitted on: slower than Eq. 1, pieces or not
    assert plan.chunks[1].sp_layout_delta_s > 0 and f"{want[1][0]}/{want[1][1]} cheapest" in \
        plan.chunks[1].sp_layout_reason
    spec = ",".join(f"{c.tokens}x{c.sp_size}:{c.sp_layout}/{c.sp_micro_partitions}"
                    for c in plan.chunks)
    assert parse_plan_layouts(spec) == want
    forced = forced_plan("f", 131072, spec, (0,) * 8 + (1,) * 8, num_kv_heads=8, num_heads=32)
    assert [(c.sp_layout, c.sp_micro_partitions) for c in forced.chunks] == want
    lay = plan_layout(forced)[0][1]
    task = chunk_task(forced, 1, 0, lay, compact_tokens(range(131072)), 2,
                      RunOptions("overlap", None, False, (), None, None), 0, timeout_s=5.0,
                      emulated=False)
    blocks = [normalize_ranges(list(h) + list(c)) for h, c in zip(lay.history, lay.chunk_positions)]
    kind = type(group_attention(task, blocks, PeerLink())).__name__
    assert kind == {"ring": "PipelinedRing", "a2a": "PipelinedAllToAll"}[want[1][0]]
    # the simulator charges the pipelined chunk its delta: it ends where the plan said
    sim = PrefillPoolSim(16, prof.predict)
    sim.free_at = list(QUEUES)
    end, _ = sim.execute(plan, 0.0)
    assert end == pytest.approx(plan.chunks[-1].expected_end, abs=1e-9)
    assert sim.max_plan_deviation < 1e-9


def test_tetris_plan_shows_the_chosen_pieces_and_why(capsys):
    args = ["plan", "--pool", "16", "--node-size", "8", "--prompt-tokens", "131072",
            "--queue-times", ",".join(map(str, QUEUES)), "--sp-layouts", "ring,a2a",
            "--inter-node-gbps", "5"]
    assert main(args + ["--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert main(args + ["--sp-micro-partitions", "1,2,4,8", "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert [c["sp_micro_partitions"] for c in before["chunks"]] == [1, 1]
    assert [(c["sp_layout"], c["sp_micro_partitions"]) for c in after["chunks"]] == [
        ("ring", 1), ("a2a", 8)]
    assert after["ttft_estimate"] < before["ttft_estimate"]
    assert main(args + ["--sp-micro-partitions", "1,2,4,8"]) == 0
    text = capsys.readouterr().out
    assert "layout a2a/8: comm ring" in text and "a2a/4 " in text and "a2a/8 cheapest" in text


def test_the_emulated_executor_waits_a_pipelined_ring_chunk_s_delta():
    """EMULATION follows the plan as the simulator does: a ring/4 chunk waits Eq. 1 plus its
    delta, a whole-block ring chunk Eq. 1 alone on the fitted links and Eq. 1 plus its ring's
    correction on others (sp_comm.py)."""
    from tetris.actors.prefill.executor import EmulatedExecutor
    from tetris.actors.prefill.layout import forced_plan, plan_layout
    from tetris.actors.prefill.messages import ChunkTask

    profile = load_profile("a100-llama3-8b-tp1")
    plan = forced_plan("e", 3000, "1000x1,restx2:ring/4", (0, 0), num_kv_heads=8)
    lay = plan_layout(plan)[0][1]
    task = ChunkTask(request_id="e", chunk_index=1, num_chunks=2, seq=0, group=lay.group,
                     rank=1, chunk_start=1000, chunk_end=3000, prompt_tokens=3000,
                     chunk_positions=lay.chunk_positions, history=lay.history, moves=lay.moves,
                     sp_micro_partitions=4, sp_layout_delta_s=-0.004)
    waits = []
    ex = EmulatedExecutor(profile, sleep=waits.append, clock=lambda: 0.0)
    ex.execute(task)
    ex.execute(msgspec.structs.replace(task, sp_micro_partitions=1, sp_layout_delta_s=0.0))
    ex.execute(msgspec.structs.replace(task, sp_micro_partitions=1, sp_layout_delta_s=0.003))
    eq1 = profile.predict(2, 1000, 2000)
    assert waits == [pytest.approx(eq1 - 0.004), pytest.approx(eq1), pytest.approx(eq1 + 0.003)]
