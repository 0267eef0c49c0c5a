"""Prefix caching on a prefill worker's KV store and in the pool's layout (no Ray)."""

from __future__ import annotations

import torch
from tetris.actors.prefill.kv_store import PagedKVStore
from tetris.actors.prefill.layout import plan_layout
from tetris.actors.prefill.zigzag import normalize_ranges, ranges_len

from tetris.plan import Chunk, PrefillPlan


def test_copy_prefix_copies_only_positions_below_the_cut_and_survives_the_source():
    store = PagedKVStore(2, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=2)
    held = ((0, 3), (7, 12))          # a zigzag share: not a prefix
    store.reserve("src", held)
    pos = [0, 1, 2, 7, 8, 9, 10, 11]
    for layer in range(2):
        k = torch.tensor([[[p + 100.0 * layer, -p]] for p in pos])
        store.write("src", layer, held, k, k * 2)
    assert store.copy_prefix("src", "dst", 10) == ((0, 3), (7, 10))
    store.free("src")
    for layer in range(2):
        k, v = store.read("dst", layer, ((0, 3), (7, 10)))
        want = torch.tensor([[[p + 100.0 * layer, -p]] for p in (0, 1, 2, 7, 8, 9)])
        torch.testing.assert_close(k, want)
        torch.testing.assert_close(v, want * 2)
    assert store.copy_prefix("nobody", "x", 10) == () and store.requests() == ["dst"]
    assert store.copy_prefix("dst", "y", 0) == ()


def test_layout_takes_the_cached_prefix_as_a_chunk_already_run():
    cached = {3: ((0, 40), (120, 160)), 1: ((40, 120),)}
    plan = PrefillPlan("r", 300, (Chunk(160, 220, (3, 1)), Chunk(220, 300, (3, 1, 0, 2))),
                       cached_tokens=160, cached_instances=(3, 1), cached_source="s")
    layouts, final = plan_layout(plan, "overlap", cached)
    assert layouts[0].history == (((0, 40), (120, 160)), ((40, 120),))
    assert layouts[0].moves == ()                       # same group: nothing moves
    # The second chunk grows the group: the history (prefix + chunk 0) is balanced over four.
    sizes = [ranges_len(h) for h in layouts[1].history]
    assert sum(sizes) == 220 and max(sizes) - min(sizes) <= 1
    assert normalize_ranges([r for rs in final.values() for r in rs]) == ((0, 300),)
