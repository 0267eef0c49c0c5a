"""``RunSpec.tail_every``: the Long workload with every n-th prompt replaced by a tail prompt
(``benchmarks/bench_sp_layouts_sim.py --tail``), and the light load taken over the same."""

from __future__ import annotations

import pytest

from tetris.sim.experiments import (
    RunSpec,
    execution_fn,
    light_load,
    make_requests,
    run_one,
)


def test_every_nth_request_runs_the_tail_prompt_and_the_rest_stay():
    spec = RunSpec(model="8b", workload="long", policy="tetris", rate=0.2, requests=8, seed=1,
                   decode=False, improvement_rate=0.3, tail_every=4, tail_tokens=400_000)
    res, sim = run_one(spec)
    plain = make_requests("long", 0.2, 8, 1)
    assert [r.prompt_tokens for r in sim.requests] == [
        400_000 if i in (3, 7) else r.prompt_tokens for i, r in enumerate(plain)]
    assert [r.arrival_time for r in sim.requests] == [r.arrival_time for r in plain]
    # the tail was prefilled: no SP size runs 400k tokens faster than SP 16 alone
    alone = execution_fn("8b")(16, 0, 400_000)
    assert res.ttft_s[3] >= alone - 1e-9 and res.ttft_s[7] >= alone - 1e-9
    untailed, _ = run_one(RunSpec(**{**{f: getattr(spec, f) for f in spec.__struct_fields__},
                                     "tail_every": 0}))
    assert max(untailed.ttft_s) < alone


def test_light_load_over_the_tailed_workload():
    run = execution_fn("8b")
    p50, p99 = light_load("8b", "long", n=40, tail_every=1, tail_tokens=300_000)
    assert p50 == pytest.approx(min(run(s, 0, 300_000) for s in (1, 2, 4, 8, 16)))
    assert p99 == pytest.approx(p50)
    assert light_load("8b", "long", n=40)[1] < p50   # no Long prompt reaches 300k tokens
