"""Zigzag layout and cache-balancing plans (pure functions)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetris.actors.prefill.balance import even_targets, plan_balance, take_tail
from tetris.actors.prefill.zigzag import (
    normalize_ranges,
    ranges_len,
    ranges_to_list,
    zigzag_layout,
    zigzag_pieces,
)


def test_zigzag_pairs_early_and_late_pieces():
    # 16 tokens on 4 members: 8 pieces of 2; member 0 takes pieces 0 and 7.
    layout = zigzag_layout(100, 116, 4)
    assert layout[0] == ((100, 102), (114, 116))
    assert layout[3] == ((106, 110),)   # pieces 3 and 4 touch and are joined


@given(start=st.integers(0, 50), length=st.integers(0, 200), s=st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_zigzag_covers_chunk_once_and_is_even(start, length, s):
    layout = zigzag_layout(start, start + length, s)
    flat = sorted(p for r in layout for p in ranges_to_list(r))
    assert flat == list(range(start, start + length))
    sizes = [ranges_len(r) for r in layout]
    assert max(sizes) - min(sizes) <= 2
    # Causal work (keys each query sees inside the chunk) differs by at most ~2 queries' worth,
    # where a contiguous split would differ by about length**2 / s.
    work = [sum(p - start + 1 for p in ranges_to_list(r)) for r in layout]
    assert max(work) - min(work) <= 2 * (length + 1)


def test_zigzag_rejects_bad_rank():
    with pytest.raises(ValueError):
        zigzag_pieces(0, 10, 0)


def test_take_tail_splits_last_positions():
    kept, taken = take_tail(((0, 4), (10, 13)), 5)
    assert kept == ((0, 2),)
    assert taken == ((2, 4), (10, 13))


def test_balance_fig5_old_members_send_second_half():
    # Paper Fig. 5: P0-P3 hold 4 x 100 history tokens; P4-P7 join; each old member sends 50.
    held = [((r * 100, r * 100 + 100),) for r in range(4)]
    moves, after = plan_balance(held, tuple(range(8)))
    assert [(m.src, m.dst, m.positions) for m in moves] == [
        (r, r + 4, ((r * 100 + 50, r * 100 + 100),)) for r in range(4)
    ]
    assert [ranges_len(a) for a in after] == [50] * 8


@given(
    counts=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    grow=st.integers(0, 4),
)
@settings(max_examples=80, deadline=None)
def test_balance_is_even_minimal_and_conserves_positions(counts, grow):
    # Old members hold interleaved random-size shares of a history.
    pos, held = 0, []
    for c in counts:
        held.append(((pos, pos + c),))
        pos += c
    group = tuple(range(len(counts) + grow))
    moves, after = plan_balance(held, group)
    total = sum(counts)
    sizes = [ranges_len(a) for a in after]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(p for a in after for p in ranges_to_list(a)) == list(range(total))
    targets = even_targets(counts + [0] * grow, total)
    moved = sum(ranges_len(m.positions) for m in moves)
    assert moved == sum(max(0, n - t) for n, t in zip(counts + [0] * grow, targets))
    for m in moves:
        assert m.src != m.dst
        # Senders never receive; receivers never send.
        assert all(o.dst != m.src for o in moves)
    if all(n >= total // len(group) + 1 for n in counts) and grow:
        assert all(m.src < len(counts) <= m.dst for m in moves)


def test_normalize_rejects_overlap():
    with pytest.raises(ValueError):
        normalize_ranges([(0, 5), (3, 8)])
