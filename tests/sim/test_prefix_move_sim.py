"""SIMULATION of a moved cached prefix (issue #23 item 2, "move"): chunk 0 waits for the move
to land on its group (the planner's price), and the prefix's KV reaches decode from that
group, not from the holders."""

from __future__ import annotations

import pytest

from tetris.sim.prefix_experiments import run_prefix
from tetris.sim.prefix_transfer import PREFIX_CHUNK
from tetris.sim.workload import SimRequest

DOC = tuple(range(1000, 1064))   # 64 blocks of 512 tokens: a 32K-token document
CACHED = 64 * 512
BYTES = CACHED * 32 * 2 * 8 * 128 * 2   # LLaMA3-8B's KV of the document (TP 1 instances)
NIC = 25e9                              # one 200 Gb/s NIC per GPU (paper §7.1)


def _run(placement):
    reqs = [SimRequest("a", 0.0, CACHED + 100, 16, block_hashes=DOC),
            SimRequest("c", 20.0, CACHED + 600, 16, block_hashes=DOC + (5, 6))]
    _, sim = run_prefix(reqs, cache=True, decode=True, placement=placement, block_tokens=512)
    plans = {p.request_id: p for p in sim.plans}
    runs = [r for r in sim.prefill.runs if r.request_id == "c"]
    return sim, plans, runs


def test_a_moved_prefix_lands_before_chunk_0_and_streams_to_decode_from_its_group():
    sim, plans, runs = _run("move")
    holders, plan = plans["a"].instances, plans["c"]
    assert plan.cached_moved and plan.cached_tokens == CACHED
    assert plan.cached_instances == holders == tuple(range(8))   # node 0, idle since 0.6 s
    g = plan.chunks[0].instances
    assert g == (8, 9, 10, 11)                                   # node 1
    # Every pair crosses nodes; each receiver takes a quarter over its NIC (the slower side
    # than each holder's eighth), plus one message latency. G is idle at 20 s: without the
    # move chunk 0 would start at the arrival.
    landing = 20.0 + BYTES / 4 / NIC + 10e-6
    assert runs[0].start == pytest.approx(landing)
    assert runs[0].start == pytest.approx(plan.chunks[0].expected_start)
    # The prefix's pseudo-chunk is sent by G (4 NICs), not the 8 holders.
    kv = sim._kv_runs(plan, runs, 0)
    assert kv[0].index == PREFIX_CHUNK and kv[0].instances == g
    assert kv[0].tokens == CACHED and kv[0].start == runs[0].start
    recv = 8 * NIC   # a TP-8 decode instance
    assert sim.transfer.ready_time(kv[:1], 0.0) == pytest.approx(
        landing + BYTES / min(4 * NIC, recv))


def test_an_extended_prefix_starts_on_arrival_and_streams_from_its_holders():
    sim, plans, runs = _run("extend")
    plan = plans["c"]
    assert not plan.cached_moved and plan.chunks[0].instances[:8] == tuple(range(8))
    assert runs[0].start == 20.0
    kv = sim._kv_runs(plan, runs, 0)
    assert kv[0].index == PREFIX_CHUNK and kv[0].instances == tuple(range(8))
