"""The headline's SIMULATION side (tetris/bench/elastic_headline.py) on the emulated 8B
deployment: with decode instances smaller than the tail, whole placement refuses it before any
prefill (the live 429) and elastic placement serves it over both instances; with the paper's
4.27M-token instances both placements run the same schedule."""

from __future__ import annotations

import math

from tetris.bench.elastic_headline import elastic_trace, placement, simulate_placement
from tetris.config import load_deployment

BASE = load_deployment("paper-llama3-8b-emulated.toml")


def _trace():
    return elastic_trace("short", 1.0, 8, 0, 8, tail_every=4, tail_tokens=100_000)


def test_a_tail_larger_than_any_instance_is_refused_whole_and_spread_elastic():
    trace = _trace()
    assert [r.prompt_tokens for r in trace].count(100_000) == 2
    whole = simulate_placement(placement(BASE, False, 64_000), trace)
    elastic = simulate_placement(placement(BASE, True, 64_000), trace)
    assert (whole["refused"], whole["served"], whole["sharded"]) == (2, 6, 0)
    assert (elastic["refused"], elastic["served"], elastic["sharded"]) == (0, 8, 2)
    # the tail's 100K-token prefill sets the TTFT tail of the elastic run only
    assert elastic["ttft_s"]["p99"] > 2 * whole["ttft_s"]["p99"]
    # beyond both instances' sum elastic refuses too
    beyond = simulate_placement(placement(BASE, True, 40_000), trace)
    assert (beyond["refused"], beyond["sharded"]) == (2, 0)


def test_with_the_paper_instances_both_placements_run_the_same_schedule():
    trace = _trace()
    whole = simulate_placement(placement(BASE, False), trace)
    elastic = simulate_placement(placement(BASE, True), trace)
    assert elastic["sharded"] == 0 and whole["refused"] == elastic["refused"] == 0
    for key in ("ttft_s", "tbt_s"):
        for q in ("p50", "p99"):
            assert whole[key][q] == elastic[key][q] and not math.isnan(whole[key][q])


def test_a_tail_the_rooms_cannot_hold_at_its_arrival_is_refused_as_live():
    # 4 short requests at 1 req/s; the 4th (100K tokens) arrives while the others' KV is
    # booked: the two 64K instances' free room no longer adds up to it, so the placer falls
    # back to whole on the freest, which the live reservation refuses (DecodeFull)
    trace = elastic_trace("short", 1.0, 4, 0, 8, tail_every=4, tail_tokens=100_000)
    assert sum(r.prompt_tokens for r in trace[:3]) + 100_000 > 2 * 64_000
    elastic = simulate_placement(placement(BASE, True, 64_000), trace)
    assert (elastic["refused"], elastic["served"], elastic["sharded"]) == (1, 3, 0)
