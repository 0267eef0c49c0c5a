"""SIMULATION of prefix caching: the shared-prefix workload, its Mooncake trace fields, and the
simulator driving the same ControlPlane and PrefixIndex as the live system."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from tetris.control.prefix_index import block_hashes
from tetris.sim.prefix_experiments import run_prefix
from tetris.sim.prefix_workload import (
    PrefixWorkload,
    load_mooncake_trace,
    save_mooncake_trace,
    segment_hashes,
    shared_prefix_workload,
)

SMALL = PrefixWorkload(documents=6, sessions=4, doc_tokens=(4096, 16384),
                       session_context=(1024, 4096), block_tokens=256, concurrent_streams=3)


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _tokens(segments):
    # A token per (segment, offset), distinct across segments: what the segments stand for.
    return [hash((key, off)) % (1 << 40) for key, n in segments for off in range(n)]


@pytest.mark.parametrize("block", [4, 5])
def test_segment_hashes_share_exactly_what_token_hashes_share(block):
    prompts = [[("d", 13), ("q1", 3)], [("d", 13), ("q2", 7)], [("d", 12)], [("e", 13)],
               [("d", 13), ("q1", 3), ("a", 9)], [("d", 8), ("x", 8)]]
    for a in prompts:
        assert len(segment_hashes(a, block)) == sum(n for _, n in a) // block
        for b in prompts:
            seg = _common(segment_hashes(a, block), segment_hashes(b, block))
            tok = _common(block_hashes(_tokens(a), block), block_hashes(_tokens(b), block))
            assert seg == tok, (a, b)


def test_workload_streams_share_their_prefixes():
    reqs = shared_prefix_workload(SMALL, 1.0, seed=3)
    n_items = len(reqs)
    assert 6 * 4 + 4 * 3 <= n_items <= 6 * 8 + 4 * 6
    assert all(b.arrival_time > a.arrival_time for a, b in itertools.pairwise(reqs))
    for r in reqs:
        assert len(r.block_hashes) == r.prompt_tokens // 256
    roots: dict[int, list] = {}
    for r in reqs:
        roots.setdefault(r.block_hashes[0], []).append(r)
    assert len(roots) == 6 + 4   # one root block per stream
    # The same requests at another rate, arrivals scaled.
    other = shared_prefix_workload(SMALL, 2.0, seed=3)
    assert [r.block_hashes for r in other] == [r.block_hashes for r in reqs]
    assert other[5].arrival_time == pytest.approx(reqs[5].arrival_time / 2)


def test_questions_share_their_document_and_turns_extend_the_conversation():
    docs = shared_prefix_workload(msgspec.structs.replace(SMALL, sessions=0), 1.0, seed=4)
    by_doc: dict[int, list] = {}
    for r in docs:
        by_doc.setdefault(r.block_hashes[0], []).append(r)
    for questions in by_doc.values():
        assert 4 <= len(questions) <= 8
        doc_blocks = min(_common(a.block_hashes, b.block_hashes)
                         for a in questions for b in questions if a is not b)
        assert 4096 // 256 - 1 <= doc_blocks <= 16384 // 256
    sessions = shared_prefix_workload(msgspec.structs.replace(SMALL, documents=0), 1.0, seed=4)
    by_session: dict[int, list] = {}
    for r in sessions:
        by_session.setdefault(r.block_hashes[0], []).append(r)
    assert len(by_session) == 4
    for turns in by_session.values():
        assert 3 <= len(turns) <= 6
        for prev, cur in itertools.pairwise(turns):
            assert cur.prompt_tokens >= prev.prompt_tokens + prev.output_tokens + 64
            assert cur.block_hashes[:len(prev.block_hashes)] == prev.block_hashes


def test_mooncake_trace_round_trip_keeps_the_sharing(tmp_path):
    reqs = shared_prefix_workload(SMALL, 1.0, seed=1)[:20]
    path = tmp_path / "trace.jsonl"
    save_mooncake_trace(reqs, path)
    back = load_mooncake_trace(path)
    assert [(r.prompt_tokens, r.output_tokens) for r in back] == \
        [(r.prompt_tokens, r.output_tokens) for r in reqs]
    assert [round(r.arrival_time, 3) for r in back] == [round(r.arrival_time, 3) for r in reqs]
    for i in range(len(reqs)):
        for j in range(len(reqs)):
            assert _common(reqs[i].block_hashes, reqs[j].block_hashes) == \
                _common(back[i].block_hashes, back[j].block_hashes)


def test_simulated_cache_plans_suffixes_and_leaks_nothing():
    reqs = shared_prefix_workload(SMALL, 0.5, seed=0)
    off, _ = run_prefix(reqs, cache=False, block_tokens=256, rate=0.5)
    on, sim = run_prefix(reqs, cache=True, block_tokens=256, capacity_blocks=400, rate=0.5)
    assert on.hit_rate > 0.5 and on.ttft_p50 < off.ttft_p50
    index = sim.control.prefix_index
    index.check()
    assert index.stats()["held_runs"] == 0 and index.stats()["blocks"] <= 400
    assert sim.control.held()["prefix_refs"] == 0
    by_id = {r.request_id: r for r in reqs}
    hits = [p for p in sim.plans if p.cached_tokens]
    for p in hits:
        p.validate(16)
        # A hit is whole blocks of the prompt's, short of the whole prompt.
        assert p.cached_tokens % 256 == 0 or p.cached_tokens == p.prompt_tokens - 1
        assert p.cached_tokens < by_id[p.request_id].prompt_tokens
    # The simulated pool ran each plan as planned (profile execution), prefix as history.
    assert sim.prefill.max_plan_deviation < 1e-9
    assert any(run.history_tokens > 0 and run.index == 0 for run in sim.prefill.runs)


def test_without_the_index_the_hashes_change_nothing():
    reqs = shared_prefix_workload(SMALL, 1.0, seed=2)
    bare = [msgspec.structs.replace(r, block_hashes=()) for r in reqs]
    a, sim_a = run_prefix(reqs, cache=False, block_tokens=256, decode=True)
    b, sim_b = run_prefix(bare, cache=False, block_tokens=256, decode=True)
    assert sim_a.ttft.tolist() == sim_b.ttft.tolist()
    assert a.ttft_p99 == b.ttft_p99 and a.hit_rate == 0.0
