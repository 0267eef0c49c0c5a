"""The ring over micro-partitions (actors/prefill/ring_pipeline.py): over gloo with ranks as
threads against causal attention and the whole-block ring; its schedule (piece m+1 in flight
while piece m is attended); its selection per chunk; and forced plans on ``ThreadedPool``
(real executors on threads) against the single instance."""

from __future__ import annotations

import threading

import pytest
import torch
from cdsp_check import check_plan, prompt
from gloo_threads import run_ranks
from stored_kv import assert_stored_kv_within_fp32
from tetris.actors.prefill import ring_pipeline
from tetris.actors.prefill.balance import plan_balance
from tetris.actors.prefill.chunks import RunOptions, chunk_task
from tetris.actors.prefill.group_attention import group_attention
from tetris.actors.prefill.kv_store import ranges_tensor
from tetris.actors.prefill.layout import forced_plan, parse_plan_layouts, plan_layout
from tetris.actors.prefill.ring import RingAttention
from tetris.actors.prefill.ring_pipeline import PipelinedRing, micro_cuts
from tetris.actors.prefill.threaded import ThreadedPool
from tetris.actors.prefill.world import PeerLink
from tetris.actors.prefill.zigzag import normalize_ranges, zigzag_layout
from tetris.kernels.attention import attention_with_lse_ref

from tetris.token_ids import compact_tokens


def _full(seed, n, hq=8, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g),
            torch.randn(n, hkv, d, generator=g))


def _shares(hist, end, s_old, s):
    """Zigzag shares of [hist, end) on s members after history [0, hist) ran on s_old."""
    _, after = plan_balance(list(zigzag_layout(0, hist, s_old)), tuple(range(s)))
    chunk = zigzag_layout(hist, end, s)
    blocks = [ranges_tensor(tuple(sorted(after[r] + chunk[r]))) for r in range(s)]
    return [ranges_tensor(c) for c in chunk], blocks


def test_micro_cuts_cover_the_block_in_order():
    assert micro_cuts(10, 3) == [0, 3, 6, 10]
    assert micro_cuts(2, 4) == [0, 0, 1, 1, 2]      # more pieces than rows: some are empty
    assert micro_cuts(0, 2) == [0, 0, 0]


@pytest.mark.parametrize("s,s_old,micro", [(2, 1, 3), (3, 2, 4), (4, 2, 40), (4, 1, 1)])
def test_pipelined_ring_over_gloo_matches_causal_attention_and_the_ring(s, s_old, micro):
    """Two layers back to back with history; M = 40 leaves most pieces of ~17-row blocks empty."""
    hist, end = 29, 29 + 41
    q, k, v = _full(s + micro, end)
    q_pos, blocks = _shares(hist, end, s_old, s)
    def member(r, world):
        group = tuple(range(s))
        piped = PipelinedRing(group, r, blocks, tag=7, timeout_s=20.0, link=world,
                              micro_partitions=micro)
        whole = RingAttention(group, r, blocks, tag=8, timeout_s=20.0, link=world)
        outs = [(piped(q[q_pos[r]] * (1 + i), q_pos[r], k[blocks[r]], v[blocks[r]], layer=i),
                 whole(q[q_pos[r]] * (1 + i), q_pos[r], k[blocks[r]], v[blocks[r]], layer=i))
                for i in range(2)]
        return outs, piped.sent_elements, whole.sent_elements

    got = run_ranks(s, member)
    for r, (outs, sent_piped, sent_whole) in enumerate(got):
        # the same volume: every block but the last received travels once per step
        assert sent_piped == sent_whole == 2 * sum(
            blocks[(r - t) % s].numel() * 2 * 2 * 8 for t in range(s - 1))
        for i, (piped, whole) in enumerate(outs):
            ref_i, _ = attention_with_lse_ref(q[:end] * (1 + i), k[:end], v[:end], causal=True)
            torch.testing.assert_close(piped, ref_i[q_pos[r]], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(piped, whole, rtol=1e-5, atol=1e-5)


class _Recording(PeerLink):
    """A world that logs when each exchange is posted and waited (per member thread)."""

    def __init__(self, world, log):
        self.world, self.log = world, log

    def exchange(self, sends, recvs, tag):
        works = self.world.exchange(sends, recvs, tag)
        n = len(self.log)
        self.log.append(["post", n, False])
        return [_Work(w, self.log, n) for w in works] or [_Work(None, self.log, n)]


class _Work:
    def __init__(self, work, log, n):
        self.work, self.log, self.n = work, log, n

    def wait(self, timeout):
        self.log[self.n][2] = True
        return True if self.work is None else self.work.wait(timeout)


def test_the_next_piece_is_in_flight_while_a_piece_is_attended(monkeypatch):
    """At every attention on piece m of a received block, the exchange bringing piece m+1 has
    been posted and not yet waited on: the overlap the module promises, observed."""
    s, micro = 2, 4
    q, k, v = _full(1, 64)
    q_pos, blocks = _shares(0, 64, 1, s)
    real = ring_pipeline.partial_attention
    member_log = threading.local()

    def spy(*a):   # the member's exchange log as this attention starts
        member_log.snapshots.append([list(e) for e in member_log.log])
        return real(*a)

    monkeypatch.setattr(ring_pipeline, "partial_attention", spy)

    def member(r, world):
        member_log.log, member_log.snapshots = [], []
        ring = PipelinedRing(tuple(range(s)), r, blocks, 3, 20.0,
                             _Recording(world, member_log.log), micro_partitions=micro)
        ring(q[q_pos[r]], q_pos[r], k[blocks[r]], v[blocks[r]])
        return member_log.snapshots

    for snaps in run_ranks(s, member):
        assert len(snaps) == 1 + (s - 1) * micro
        # step 0 posts exchanges 0..M-1 (piece m of the own block out, piece m of the next in)
        # and attends the own block whole while all of them are in flight
        assert [e[0] for e in snaps[0]] == ["post"] * micro and not any(e[2] for e in snaps[0])
        # attending received piece m (step 1): exchange m is done and m+1 still in flight
        for m in range(micro - 1):
            snap = snaps[1 + m]
            assert snap[m][2] is True and snap[m + 1][2] is False, (m, snap)


def test_plan_spec_and_forced_plan_select_the_pipelined_ring_per_chunk():
    assert parse_plan_layouts("300x1:ring/2,restx2") == [("ring", 2), ("ring", 1)]
    plan = forced_plan("p", 1500, "300x1,500x2:ring/4,restx3:a2a/2", (0, 0, 1, 1),
                       num_kv_heads=2)
    # a2a/2 on 3 members falls back to the whole-block ring, as before
    assert [(c.sp_layout, c.sp_micro_partitions) for c in plan.chunks] == [
        ("ring", 1), ("ring", 4), ("ring", 1)]
    layouts, _ = plan_layout(plan)
    opts = RunOptions("overlap", None, False, (), None, None)
    kinds = []
    for j, lay in enumerate(layouts):
        task = chunk_task(plan, j, 0, lay, compact_tokens(range(1500)), j + 1, opts, 0, timeout_s=5.0,
                          emulated=False)
        blocks = [normalize_ranges(list(h) + list(c))
                  for h, c in zip(lay.history, lay.chunk_positions)]
        kinds.append(type(group_attention(task, blocks, PeerLink())).__name__)
    assert kinds == ["RingAttention", "PipelinedRing", "RingAttention"]


@pytest.fixture(scope="module")
def local_pool(model):
    return ThreadedPool(model, 4, num_blocks=96, block_size=16, timeout_s=20.0)


@pytest.mark.parametrize("n,spec,layouts", [
    (1000, "300x2:ring/3,restx4:ring/4", [("ring", 3), ("ring", 4)]),     # history: pipelined
    (1000, "300x1,400x2:ring/5,restx4", [("ring", 1), ("ring", 5), ("ring", 1)]),   # mixed
    (1100, "300x2:a2a/3,400x2:ring/4,restx4:sptp",                           # three layouts
     [("a2a", 3), ("ring", 4), ("sptp", 1)]),
])
def test_pipelined_ring_plans_match_single_instance(local_pool, model, monkeypatch, n, spec,
                                                    layouts):
    plan = forced_plan(f"ringp-{spec}", n, spec, (0, 0, 1, 1), num_kv_heads=2, num_heads=8)
    assert [(c.sp_layout, c.sp_micro_partitions) for c in plan.chunks] == layouts
    calls = []
    real = PipelinedRing.__call__

    def counted(self, *a, **kw):
        calls.append(self.micro_partitions)
        return real(self, *a, **kw)

    monkeypatch.setattr(PipelinedRing, "__call__", counted)
    ids = prompt(n, n)
    check_plan(local_pool, model, plan, ids)
    # every member of every pipelined chunk ran it on every layer
    want = sorted(m for c in plan.chunks if c.sp_layout == "ring" and c.sp_micro_partitions > 1
                  for m in [c.sp_micro_partitions] * (c.sp_size * model.num_layers))
    assert sorted(calls) == want
    assert_stored_kv_within_fp32(local_pool, model, plan, ids)
    local_pool.release(plan.request_id)
