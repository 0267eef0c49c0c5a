"""SIMULATION of the decode side of prefix caching: a cached prefix's KV streamed to decode is
charged by the transfer model (as the live pool streams pseudo-chunk -1), and with
``decode_runs`` a conversation's next turn goes to the decode instance that kept the previous
turn (the control plane's ``DecodeKept``, as the dispatcher uses it) and is charged only its
suffix's transfer."""

from __future__ import annotations

import pytest

from tetris.plan import Chunk, PrefillPlan
from tetris.sim.cluster import ClusterSpec, Simulation, cluster_by_name
from tetris.sim.prefill import ChunkRun
from tetris.sim.prefix_decode import PrefixDecodeSimulation
from tetris.sim.prefix_experiments import run_prefix
from tetris.sim.prefix_transfer import PREFIX_CHUNK, with_prefix_shard
from tetris.sim.prefix_workload import answer_key, decode_kept_hashes, segment_hashes
from tetris.sim.transfer import KVTransferModel
from tetris.sim.workload import SimRequest

BLOCK = 256
CLUSTER = cluster_by_name("8b")


def test_prefix_transfer_is_charged_as_a_chunk_from_its_holders():
    model = CLUSTER.transfer_model()
    plan = PrefillPlan("q2", 66048, (Chunk(65536, 66048, (3, 4, 0, 1)),), cached_tokens=65536,
                       cached_instances=(3, 4), cached_source="q1")
    chunk = ChunkRun("q2", 0, (3, 4, 0, 1), 65536, 512, 2.0, 2.05, 2.0, 2.05)
    runs = with_prefix_shard(plan, [chunk])
    assert [r.index for r in runs] == [PREFIX_CHUNK, 0]
    assert runs[0].instances == (3, 4) and runs[0].tokens == 65536
    # Eq. of sim/transfer.py: the prefix (all layers ready at chunk 0's start) from two NICs,
    # then the chunk's KV behind it on the receive link.
    prefix_s = 65536 * CLUSTER.kv_bytes_per_token / (2 * 25e9)
    L = CLUSTER.num_layers
    x = 512 * CLUSTER.kv_bytes_per_token / (4 * 25e9) / L
    want = max(2.05 + x, 2.0 + 0.05 / L + L * x, 2.0 + prefix_s + L * x)
    assert model.ready_time(runs, 0.0) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(2.0 + prefix_s + L * x, rel=1e-12)   # the prefix dominates
    assert model.ready_time([chunk], 0.0) == pytest.approx(2.05 + x, rel=1e-12)
    # a suffix computing longer than the prefix takes to cross hides the prefix's transfer
    slow = ChunkRun("q2", 0, (3, 4, 0, 1), 65536, 512, 2.0, 2.5, 2.0, 2.5)
    assert model.ready_time(with_prefix_shard(plan, [slow]), 0.0) == pytest.approx(2.5 + x)
    # a busy receive link delays the prefix too
    assert model.ready_time(runs, 5.0) == pytest.approx(5.0 + prefix_s + L * x, rel=1e-12)
    # nothing cached, or the prefix not streamed (the decode instance holds it): the chunks only
    plain = PrefillPlan("q1", 512, (Chunk(0, 512, (0,)),))
    assert with_prefix_shard(plain, [chunk]) == [chunk]
    assert with_prefix_shard(plan, [chunk], streamed=False) == [chunk]


def _items():
    """r0 (decoding long on one instance), the first turn r1, r3 (large, decoding long on
    r1's instance), the second turn r2 resending r1 and its answer."""
    r1 = [("ses/ctx", 120000), ("ses/user0", 300)]
    r2 = r1 + [(answer_key(r1), 40), ("ses/user1", 300)]
    rows = [("r0", 0.0, [("x", 2000)], 6000), ("r1", 0.05, r1, 40),
            ("r3", 4.0, [("y", 200000)], 6000), ("r2", 30.0, r2, 40)]
    return [(SimRequest(rid, t, sum(n for _, n in segs), out, segment_hashes(segs, BLOCK)), segs)
            for rid, t, segs, out in rows]


def _slow_network(monkeypatch) -> KVTransferModel:
    """10 Gb/s per prefill NIC, 80 into a decode instance (the paper's 200 Gb/s NICs move the
    prefix faster than the suffix's Eq. 1 history term computes: its transfer hides)."""
    slow = KVTransferModel(CLUSTER.kv_bytes_per_token, CLUSTER.num_layers, 10e9 / 8, 80e9 / 8)
    monkeypatch.setattr(ClusterSpec, "transfer_model", lambda self: slow)
    return slow


def _run(decode_runs: int, monkeypatch):
    """The two-turn trace with the cache on; the decode instance each request was routed to."""
    where: dict[str, int] = {}
    base = Simulation._admit

    def spy(self, now, r, cached):
        d, plan = base(self, now, r, cached)
        where[r.request_id] = d
        return d, plan

    monkeypatch.setattr(Simulation, "_admit", spy)
    items = _items()
    res, sim = run_prefix([r for r, _ in items], cache=True, block_tokens=BLOCK,
                          capacity_blocks=4096, decode=True, decode_runs=decode_runs,
                          kept=decode_kept_hashes(items, BLOCK), rate=1.0)
    return res, sim, {**where, **getattr(sim, "instance_of", {})}


def _kv(sim, rid: str):
    return next(d for r, d in zip(sim.requests, sim.decode_reqs) if r.request_id == rid)


def test_second_turn_goes_to_the_holder_and_streams_only_its_suffix(monkeypatch):
    model = _slow_network(monkeypatch)
    reuse, sim, where = _run(2, monkeypatch)
    off, plain, plain_where = _run(0, monkeypatch)
    assert isinstance(sim, PrefixDecodeSimulation)
    assert not isinstance(plain, PrefixDecodeSimulation)
    plan = next(p for p in sim.plans if p.request_id == "r2")
    cached = plan.cached_tokens
    # the second turn hit the prefill pool's cache: the first turn's prompt, whole blocks
    assert cached == (120000 + 300) // BLOCK * BLOCK
    assert next(p for p in plain.plans if p.request_id == "r2").cached_tokens == cached
    # without decode reuse the router sends it to the other instance (r3, large and long,
    # made the first turn's instance the busier one) ...
    assert plain_where["r3"] == plain_where["r1"] != plain_where["r2"]
    # ... with it, to the instance that kept the first turn, which copies the cached prefix
    assert where["r1"] == where["r3"] == where["r2"]
    assert sim.copied == {"r2": cached}
    assert (reuse.decode_reuses, reuse.decode_reused_tokens) == (1, cached)
    assert (off.decode_reuses, off.decode_reused_tokens) == (0, 0)
    # the prefill is the same either way: same first token
    assert _kv(sim, "r2").first_token_time == pytest.approx(_kv(plain, "r2").first_token_time)
    # transfer: the suffix's chunk alone with reuse; the prefix's bytes as well without
    start = next(r.start for r in sim.prefill.runs if r.request_id == "r2")
    prefix_s = model.chunk_seconds(cached, len(plan.cached_instances))
    end = next(r.end for r in sim.prefill.runs if r.request_id == "r2")
    assert prefix_s > 2 * (end - start)   # the prefix's transfer is not hidden by the chunk
    assert _kv(sim, "r2").ready_time < end + prefix_s / 4
    assert _kv(plain, "r2").ready_time >= start + prefix_s


def test_without_decode_runs_a_cached_prefix_is_streamed_and_charged(monkeypatch):
    """With decode_runs 0 every hit streams its prefix: the KV arrives the prefix's transfer
    time later than the chunks alone would bring it."""
    model = _slow_network(monkeypatch)
    _, plain, _ = _run(0, monkeypatch)
    plan = next(p for p in plain.plans if p.request_id == "r2")
    runs = [r for r in plain.prefill.runs if r.request_id == "r2"]
    alone = model.ready_time(runs, 0.0)
    prefix_s = model.chunk_seconds(plan.cached_tokens, len(plan.cached_instances))
    chunk_s = model.chunk_seconds(runs[0].tokens, len(runs[0].instances))
    got = _kv(plain, "r2").ready_time
    # the prefix from chunk 0's start, then the chunk's layers behind it (sim/transfer.py)
    assert got == pytest.approx(runs[0].start + prefix_s + chunk_s, rel=1e-12)
    assert got - alone > 0.5 * prefix_s
