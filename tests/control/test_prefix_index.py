"""The prefix index: chained block hashes, partial hits, LRU eviction, references, clear."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tetris.config import DeploymentConfig, ModelConfig, PrefixCacheConfig
from tetris.control.prefix_index import KvLocation, PrefixIndex, block_hashes

B = 4
LOC_A = KvLocation((0, 1))
LOC_B = KvLocation((2,), decode_instance=1)


def test_hash_chains_on_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], B)
    assert len(a) == 2   # the trailing partial block has no hash
    # Same second block after a different first block: a different hash (chained).
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], B)
    assert a[1] != b[1] and a[0] != b[0]
    assert block_hashes([1, 2, 3, 4, 0, 0, 0, 0], B)[0] == a[0]
    assert len(set(a)) == 2


def test_hash_is_the_same_in_another_process():
    code = ("from tetris.control.prefix_index import block_hashes; "
            "print(block_hashes(list(range(12)), 4))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123"}).stdout.strip()
    assert out == str(block_hashes(list(range(12)), 4))


def test_partial_hit_counts_whole_blocks_only():
    idx = PrefixIndex(B, capacity_blocks=16)
    cached = list(range(12))
    assert idx.insert("a", idx.hashes(cached), LOC_A) == 3
    # Shares 10 tokens: two whole blocks hit, the third differs inside.
    prompt = cached[:10] + [99, 98, 97, 96]
    hit = idx.match(idx.hashes(prompt))
    assert (hit.blocks, hit.tokens, hit.source, hit.location) == (2, 8, "a", LOC_A)
    assert idx.match(idx.hashes([7] * 8)).blocks == 0
    full = idx.match(idx.hashes(cached + [5]))
    assert full.tokens == 12
    assert idx.stats()["queries"] == 3 and idx.stats()["hits"] == 2
    idx.check()


def test_reinserted_blocks_move_to_the_newer_source_and_the_older_is_released():
    idx = PrefixIndex(B, capacity_blocks=16)
    idx.insert("turn1", idx.hashes(list(range(8))), LOC_A)
    idx.insert("turn2", idx.hashes(list(range(16))), LOC_B)
    assert idx.drain_released() == ["turn1"]
    hit = idx.match(idx.hashes(list(range(8))))
    assert hit.source == "turn2" and hit.location == LOC_B
    idx.check()


def test_eviction_is_lru_deepest_first():
    idx = PrefixIndex(B, capacity_blocks=4)
    a, b = idx.hashes(list(range(8))), idx.hashes(list(range(100, 108)))
    idx.insert("a", a, LOC_A)
    idx.insert("b", b, LOC_B)
    idx.match(a)  # a match is not a use: recency comes from insert and release
    c = idx.hashes(list(range(200, 204)))
    idx.insert("c", c, LOC_A)
    # "a" is least recent; its leaf (block 1) goes first, its root stays usable.
    assert idx.match(a).blocks == 1
    assert idx.match(b).blocks == 2
    idx.insert("d", idx.hashes(list(range(300, 304))), LOC_A)
    assert idx.match(a).blocks == 0
    assert idx.drain_released() == ["a"]
    idx.check()


def test_referenced_blocks_are_never_evicted_and_pins_keep_the_source():
    idx = PrefixIndex(B, capacity_blocks=3)
    a = idx.hashes(list(range(12)))
    idx.insert("a", a, LOC_A)
    hit = idx.match(a)
    idx.acquire("r1", hit)
    # Full and all referenced: nothing new fits, nothing held goes.
    assert idx.insert("x", idx.hashes(list(range(50, 54))), LOC_B) == 0
    assert idx.drain_released() == ["x"]
    assert idx.match(a).blocks == 3
    with pytest.raises(ValueError):
        idx.acquire("r1", hit)
    idx.check()
    idx.release("r1")
    idx.release("r1")   # idempotent
    assert idx.insert("x", idx.hashes(list(range(50, 54))), LOC_B) == 1
    assert idx.match(a).blocks == 2
    idx.check()


def test_a_pinned_source_outlives_its_blocks_moving_away():
    idx = PrefixIndex(B, capacity_blocks=8)
    a = idx.hashes(list(range(8)))
    idx.insert("a", a, LOC_A)
    idx.acquire("r", idx.match(a))
    idx.insert("b", idx.hashes(list(range(12))), LOC_B)   # blocks move to "b"
    assert idx.drain_released() == []                     # "r" still runs from "a"
    assert idx.location("a") == LOC_A
    idx.release("r")
    assert idx.drain_released() == ["a"]
    idx.check()


def test_clear_frees_everything_unreferenced():
    idx = PrefixIndex(B, capacity_blocks=16)
    a, b = idx.hashes(list(range(8))), idx.hashes(list(range(40, 52)))
    idx.insert("a", a, LOC_A)
    idx.insert("b", b, LOC_B)
    idx.acquire("r", idx.match(b))
    assert idx.clear() == ["a"]
    assert len(idx) == 3 and idx.match(b).blocks == 3
    idx.release("r")
    assert idx.clear() == ["b"]
    assert len(idx) == 0 and idx.stats()["sources"] == 0
    idx.check()


def test_no_leak_after_a_random_mixed_run():
    import random

    rng = random.Random(7)
    idx = PrefixIndex(B, capacity_blocks=20)
    docs = [[rng.randrange(1000) for _ in range(32)] for _ in range(5)]
    running: list[str] = []
    prompts: dict[str, list[int]] = {}
    inserted: set[str] = set()
    announced: set[str] = set()
    released: set[str] = set()
    for i in range(300):
        if inserted and rng.random() < 0.05:   # a worker replaced: a source's KV is gone
            idx.forget(rng.choice(sorted(inserted)))
        elif running and rng.random() < 0.45:
            run = running.pop(rng.randrange(len(running)))
            idx.release(run)
            if rng.random() < 0.7:   # its prefill succeeded: its blocks move to it
                idx.insert(run, prompts[run], KvLocation((0,)))
                inserted.add(run)
            else:                    # aborted: what it announced is forgotten
                idx.forget(run)
        else:
            run = f"r{i}"
            doc = rng.choice(docs)
            prompt = doc[:rng.randrange(4, 33)] + [rng.randrange(1000)] * rng.randrange(6)
            prompts[run] = idx.hashes(prompt)
            idx.acquire(run, idx.match(prompts[run]))
            # Announced at commit: its new blocks are readable before its KV exists.
            if idx.insert(run, prompts[run], KvLocation((0,)), rebind=False) and \
                    idx.location(run) is not None:
                announced.add(run)
            running.append(run)
        released.update(idx.drain_released())
        idx.check()
    for run in running:   # still in prefill: aborted, so nothing is coming from them
        idx.release(run)
        idx.forget(run)
    released.update(idx.clear())
    idx.check()
    assert len(idx) == 0 and idx.stats()["sources"] == 0
    assert idx.stats()["hits"] > 0
    # Every run that was a source was let go once nothing needed its KV, and no other.
    assert inserted <= released <= inserted | announced


def test_a_run_in_prefill_is_not_released_when_its_blocks_are_evicted():
    # Announced at commit, its blocks readable; another run's blocks evict all of them while
    # its prefill still writes its KV: freeing that KV would fail the run (seen through HTTP).
    idx = PrefixIndex(B, capacity_blocks=2)
    a, b = idx.hashes(list(range(2 * B))), idx.hashes(list(range(100, 100 + 2 * B)))
    assert idx.insert("a", a, KvLocation((0,)), rebind=False) == 2
    assert idx.insert("b", b, KvLocation((1,)), rebind=False) == 2
    assert idx.stats()["evictions"] == 2 and idx.match(a).blocks == 0
    assert idx.drain_released() == [] and idx.holds("a")   # "a" is still computing
    idx.check()
    idx.insert("a", a, KvLocation((0,)))   # its prefill ended: indexed again, evicting b's
    assert idx.match(a).blocks == 2 and idx.drain_released() == []
    idx.forget("b")                         # b never prefilled (aborted): let go at once
    assert idx.drain_released() == ["b"] and idx.sources() == ["a"]
    idx.check()


def test_config_section_defaults_and_validation():
    cfg = DeploymentConfig(model=ModelConfig())
    assert cfg.prefix_cache == PrefixCacheConfig(enabled=False, block_tokens=16,
                                                 capacity_blocks=4096)
    with pytest.raises(ValueError):
        PrefixCacheConfig(block_tokens=0)


def test_a_forgotten_source_stops_matching_and_leaves_once_unreferenced():
    idx = PrefixIndex(B, capacity_blocks=16)
    a = idx.hashes(list(range(12)))
    idx.insert("a", a, LOC_A)
    idx.acquire("r", idx.match(a[:2]))     # a running run reads two of a's blocks
    idx.forget("a")
    assert idx.match(a).blocks == 0        # the KV is gone: no new run may read it
    assert len(idx) == 2 and idx.drain_released() == []
    idx.check()
    idx.release("r")                       # the reader is over: the rest goes, "a" with it
    assert len(idx) == 0 and idx.drain_released() == ["a"]
    idx.check()
    # A newer run re-inserting the same prefix makes it match again.
    idx.insert("b", a, LOC_B)
    assert idx.match(a).source == "b"
    idx.forget("nobody")
    idx.check()
