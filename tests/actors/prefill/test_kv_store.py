"""Per-worker paged KV store keyed by request and absolute position."""

from __future__ import annotations

import pytest
import torch

from tetris.actors.prefill.kv_store import KVCapacityError, PagedKVStore


def _store(blocks=8):
    return PagedKVStore(num_layers=2, num_blocks=blocks, block_size=4, num_kv_heads=2, head_dim=3)


def _kv(positions, layer):
    p = torch.tensor(positions, dtype=torch.float32)
    k = (p[:, None, None] + 1000 * layer).expand(-1, 2, 3).clone()
    return k, -k


def test_write_read_by_absolute_position_across_reservations():
    st = _store()
    st.reserve("a", ((10, 13),))
    st.reserve("a", ((0, 5),))          # earlier positions reserved later
    for layer in range(2):
        st.write("a", layer, ((10, 13),), *_kv([10, 11, 12], layer))
        st.write("a", layer, ((0, 5),), *_kv(range(5), layer))
    k, v = st.read("a", 1, ((3, 5), (10, 12)))
    assert k[:, 0, 0].tolist() == [1003, 1004, 1010, 1011]
    assert torch.equal(v, -k)
    pos, ks, vs = st.export("a")
    assert pos.tolist() == [0, 1, 2, 3, 4, 10, 11, 12]
    assert ks.shape == (2, 8, 2, 3)
    assert ks[0, :, 0, 0].tolist() == [0, 1, 2, 3, 4, 10, 11, 12]


def test_release_returns_empty_blocks_and_keeps_the_rest():
    st = _store(blocks=4)
    st.reserve("a", ((0, 12),))          # 3 blocks
    st.write("a", 0, ((0, 12),), *_kv(range(12), 0))
    assert st.free_blocks == 1
    st.release("a", ((4, 12),))
    assert st.free_blocks == 3
    assert st.read("a", 0, ((0, 4),))[0][:, 0, 0].tolist() == [0, 1, 2, 3]
    with pytest.raises(KeyError):
        st.read("a", 0, ((4, 5),))
    st.release("a", ((0, 4),))
    assert st.requests() == [] and st.free_blocks == 4


def test_capacity_error_reserves_nothing_and_free_all():
    st = _store(blocks=2)
    st.reserve("a", ((0, 6),))
    with pytest.raises(KVCapacityError):
        st.reserve("b", ((0, 5),))
    assert st.requests() == ["a"] and st.free_blocks == 0
    # "a" still has 2 spare slots in its second block: fits without a new block.
    st.reserve("a", ((6, 8),))
    assert st.free("a") == 2 and st.free_blocks == 2


def test_duplicate_positions_rejected():
    st = _store()
    st.reserve("a", ((0, 3),))
    with pytest.raises(ValueError):
        st.reserve("a", ((2, 4),))
