"""Ring attention math in one process: zigzag shards + balanced history vs full causal attention."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tetris.actors.prefill.balance import plan_balance
from tetris.actors.prefill.kv_store import ranges_tensor
from tetris.actors.prefill.ring import simulate_ring
from tetris.actors.prefill.zigzag import zigzag_layout
from tetris.kernels.attention import attention_with_lse_ref


def _full(seed, n, hq=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g),
            torch.randn(n, hkv, d, generator=g))


def _check_chunk(q, k, v, history_layout, start, end, s):
    """Members hold history_layout[r] of [0, start) plus zigzag shares of [start, end)."""
    chunk = zigzag_layout(start, end, s)
    blocks = [ranges_tensor(tuple(sorted(history_layout[r] + chunk[r]))) for r in range(s)]
    q_pos = [ranges_tensor(c) for c in chunk]
    outs = simulate_ring([q[p] for p in q_pos], q_pos, [k[b] for b in blocks],
                         [v[b] for b in blocks], blocks)
    ref, _ = attention_with_lse_ref(q[:end], k[:end], v[:end], causal=True)
    for r in range(s):
        torch.testing.assert_close(outs[r], ref[q_pos[r]], rtol=1e-5, atol=1e-5)


def test_single_chunk_ring_matches_causal_attention():
    q, k, v = _full(0, 37)
    for s in (1, 2, 3, 4):
        _check_chunk(q, k, v, [()] * s, 0, 37, s)


@given(seed=st.integers(0, 100), hist=st.integers(1, 60), length=st.integers(1, 40),
       s_old=st.integers(1, 4), grow=st.integers(0, 4))
@settings(max_examples=25, deadline=None)
def test_chunk_with_balanced_history_matches_causal_attention(seed, hist, length, s_old, grow):
    q, k, v = _full(seed, hist + length)
    # History [0, hist) as a previous zigzag chunk left it on s_old members, then balanced.
    held = list(zigzag_layout(0, hist, s_old))
    group = tuple(range(s_old + grow))
    _, after = plan_balance(held, group)
    _check_chunk(q, k, v, list(after), hist, hist + length, len(group))
