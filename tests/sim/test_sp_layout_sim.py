"""The simulator runs each chunk on its planned SP layout: Eq. 1 plus the layout's delta."""

from __future__ import annotations

from tetris.config import SpLayoutConfig
from tetris.plan import Chunk, PrefillPlan
from tetris.sim.experiments import RunSpec, run_one
from tetris.sim.prefill import PrefillPoolSim


def _latency(sp, h, l):
    return 1.0 + l / 1000.0


def test_an_a2a_chunk_takes_eq1_plus_its_delta_a_ring_chunk_eq1():
    pool = PrefillPoolSim(4, _latency)
    ring = Chunk(0, 1000, (0, 1))                                # ring on the fitted links
    a2a = Chunk(1000, 3000, (0, 1), sp_layout="a2a", sp_layout_delta_s=-0.25)
    end, runs = pool.execute(PrefillPlan("r", 3000, (ring, a2a)), arrival=0.0)
    assert [(r.start, r.end) for r in runs] == [(0.0, 2.0), (2.0, 4.75)]
    assert end == 4.75 and pool.busy_s[:2] == [4.75, 4.75]
    # a ring on links slower than Eq. 1's fit carries its correction (layout_policy.py)
    slow = Chunk(0, 1000, (2, 3), sp_layout_delta_s=0.5)
    end, runs = pool.execute(PrefillPlan("s", 1000, (slow,)), arrival=0.0)
    assert (runs[0].start, runs[0].end) == (0.0, 2.5)


def _run(cfg):
    return run_one(RunSpec(model="8b", workload="long", policy="tetris", rate=0.5, requests=150,
                           seed=3, decode=False, sp_layout=cfg))


def test_layout_choice_on_the_paper_cluster():
    """With ring transfers hidden behind attention only SP 16 chunks (spanning both nodes, 8 KV
    heads replicated) with long history leave the ring: a few requests change, none planned
    wrong; charged in full, SP 8 chunks go all-to-all too and end earlier, as planned (the plan
    already holds the delta)."""
    ring_only, _ = _run(SpLayoutConfig())
    hidden, _ = _run(SpLayoutConfig(layouts=("ring", "a2a")))
    assert len(hidden.ttft_s) == 150 and hidden.max_plan_deviation_s < 1e-9
    changed = sum(a != b for a, b in zip(hidden.ttft_s, ring_only.ttft_s))
    assert 0 < changed < 150 // 2
    full, _ = _run(SpLayoutConfig(layouts=("ring", "a2a"), ring_overlap=False))
    assert full.max_plan_deviation_s < 1e-9
    assert full.ttft.mean < ring_only.ttft.mean
