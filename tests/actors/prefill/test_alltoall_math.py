"""SP-NTP all-to-all math in one process, and over gloo with ranks as threads: zigzag shares and
balanced history vs full causal attention; the layout's fallback and the forced plan spec."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tetris.actors.prefill.alltoall import (
    AllToAllAttention,
    resolve_sp_layout,
    simulate_all_to_all,
)
from tetris.actors.prefill.balance import plan_balance
from tetris.actors.prefill.kv_store import ranges_tensor
from tetris.actors.prefill.layout import forced_plan, parse_plan_layouts
from tetris.actors.prefill.world import World, free_port
from tetris.actors.prefill.zigzag import zigzag_layout
from tetris.kernels.attention import attention_with_lse_ref

from tetris.plan import PlanError


def _full(seed, n, hq=8, hkv=4, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g),
            torch.randn(n, hkv, d, generator=g))


def _shares(history_layout, start, end, s):
    chunk = zigzag_layout(start, end, s)
    blocks = [ranges_tensor(tuple(sorted(history_layout[r] + chunk[r]))) for r in range(s)]
    return [ranges_tensor(c) for c in chunk], blocks


def _check(outs, q, k, v, q_pos, end):
    ref, _ = attention_with_lse_ref(q[:end], k[:end], v[:end], causal=True)
    for r, p in enumerate(q_pos):
        torch.testing.assert_close(outs[r], ref[p], rtol=1e-5, atol=1e-5)


def test_single_chunk_all_to_all_matches_causal_attention():
    q, k, v = _full(0, 37)
    for s in (1, 2, 4):
        q_pos, blocks = _shares([()] * s, 0, 37, s)
        outs = simulate_all_to_all([q[p] for p in q_pos], q_pos, [k[b] for b in blocks],
                                   [v[b] for b in blocks], blocks)
        _check(outs, q, k, v, q_pos, 37)


@given(seed=st.integers(0, 100), hist=st.integers(1, 60), length=st.integers(1, 40),
       sizes=st.sampled_from([(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (3, 4), (4, 4)]))
@settings(max_examples=30, deadline=None)
def test_chunk_with_balanced_history_matches_causal_attention(seed, hist, length, sizes):
    """History as an earlier chunk left it on s_old members (any size), balanced onto a group
    of s dividing the 4 KV heads; chunks shorter than 2s leave members without queries (they
    still hold a head shard)."""
    s_old, s = sizes
    q, k, v = _full(seed, hist + length)
    _, after = plan_balance(list(zigzag_layout(0, hist, s_old)), tuple(range(s)))
    q_pos, blocks = _shares(list(after), hist, hist + length, s)
    outs = simulate_all_to_all([q[p] for p in q_pos], q_pos, [k[b] for b in blocks],
                               [v[b] for b in blocks], blocks)
    _check(outs, q, k, v, q_pos, hist + length)


def test_all_to_all_over_gloo_matches_causal_attention():
    """Three layers' all-to-alls back to back on one world (ranks are threads), with history."""
    s, hist, end = 2, 23, 60
    q, k, v = _full(3, end, hkv=2)
    _, after = plan_balance(list(zigzag_layout(0, hist, 1)), tuple(range(s)))
    q_pos, blocks = _shares(list(after), hist, end, s)
    port = free_port()
    outs: list = [None] * s
    errors: list = []

    def member(r):
        try:
            world = World(0, "127.0.0.1", port, r, s, timeout_s=20.0)
            a2a = AllToAllAttention(tuple(range(s)), r, q_pos, blocks, tag=5, timeout_s=20.0,
                                    link=world)
            outs[r] = [a2a(q[q_pos[r]] * (1 + i), q_pos[r], k[blocks[r]], v[blocks[r]], layer=i)
                       for i in range(3)]
            sent = a2a.sent_elements
            # per layer: its queries and block for the peer's heads, then the peer's outputs
            n_peer, m_r = q_pos[1 - r].numel(), blocks[r].numel()
            assert sent == 3 * (q_pos[r].numel() * 4 * 8 + m_r * 2 * 1 * 8 + n_peer * 4 * 8)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(s)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for i in range(3):
        _check([o[i] for o in outs], q * (1 + i), k, v, q_pos, end)


def test_a_group_that_cannot_split_the_heads_falls_back_to_the_ring():
    """A group dividing the KV heads, or a multiple of them (KV heads replicated), runs a2a."""
    assert resolve_sp_layout("a2a", 2, 2) == ("a2a", "")
    assert resolve_sp_layout("a2a", 4, 2) == ("a2a", "")
    with pytest.raises(ValueError, match="group of 3 does not divide 8 heads"):
        simulate_all_to_all(*[[torch.zeros(1, 8, 2)] * 3] * 2, *[[torch.zeros(1, 4, 2)] * 3] * 2,
                            [torch.zeros(1, dtype=torch.long)] * 3)
    lay, why = resolve_sp_layout("a2a", 3, 2)
    assert lay == "ring" and "group of 3 neither divides 2 KV heads" in why
    assert resolve_sp_layout("ring", 4, 2) == ("ring", "")


def test_forced_plan_spec_names_layouts_and_the_fallback():
    assert parse_plan_layouts("300x1,500x2:a2a,restx4:a2a/3") == [("ring", 1), ("a2a", 1),
                                                                   ("a2a", 3)]
    with pytest.raises(PlanError, match="micro-partitions"):
        parse_plan_layouts("300x1:sptp/2,restx2")   # ring/2 runs: ring_pipeline.py
    with pytest.raises(PlanError, match="layout 'tree'"):
        parse_plan_layouts("300x1:tree,restx2")
    plan = forced_plan("p", 1500, "300x1,500x2:a2a/4,restx3:a2a/2", (0, 0, 1, 1), num_kv_heads=2)
    assert [c.sp_layout for c in plan.chunks] == ["ring", "a2a", "ring"]
    assert [c.sp_micro_partitions for c in plan.chunks] == [1, 4, 1]
    assert plan.chunks[1].sp_layout_reason == ""
    assert "neither divides 2 KV heads" in plan.chunks[2].sp_layout_reason


@pytest.mark.parametrize("s,micro", [(2, 3), (4, 5), (2, 1)])
def test_pipelined_all_to_all_over_gloo_matches_causal_attention(s, micro):
    """Three-phase SP-NTP (micro-partitions of the chunk) over one world, with history balanced
    from one member; micro-partitions may leave members without queries in a range."""
    from tetris.actors.prefill.alltoall_pipeline import PipelinedAllToAll

    hist, end = 29, 29 + 41
    q, k, v = _full(5, end)
    _, after = plan_balance(list(zigzag_layout(0, hist, 1)), tuple(range(s)))
    q_pos, blocks = _shares(list(after), hist, end, s)
    port = free_port()
    outs: list = [None] * s
    errors: list = []

    def member(r):
        try:
            world = World(0, "127.0.0.1", port, r, s, timeout_s=20.0)
            a2a = PipelinedAllToAll(tuple(range(s)), r, q_pos, blocks, tag=7, timeout_s=20.0,
                                    link=world, micro_partitions=micro)
            outs[r] = [a2a(q[q_pos[r]] * (1 + i), q_pos[r], k[blocks[r]], v[blocks[r]], layer=i)
                       for i in range(2)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(s)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for i in range(2):
        _check([o[i] for o in outs], q * (1 + i), k, v, q_pos, end)
