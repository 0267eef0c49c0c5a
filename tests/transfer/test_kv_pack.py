"""kv_pack: gather a request's KV by absolute position out of one paged cache, scatter it into
another with a different block table; bitwise equality and untouched neighbours."""

from __future__ import annotations

import pytest
import torch

from tetris.kernels.kv_pack import pack_kv, packed_bytes_per_token, positions_to_slots, unpack_kv


def _cache(layers, blocks, bs, hkv, d, seed=None, dtype=torch.float32):
    if seed is None:
        return [(torch.zeros(blocks, bs, hkv, d, dtype=dtype), torch.zeros(blocks, bs, hkv, d, dtype=dtype))
                for _ in range(layers)]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(blocks, bs, hkv, d, generator=g).to(dtype),
             torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)) for _ in range(layers)]


def test_positions_to_slots_follows_the_block_table():
    table = torch.tensor([5, 2, 9], dtype=torch.int32)
    slots = positions_to_slots(table, torch.tensor([0, 3, 4, 7, 8, 11]), 4)
    assert slots.tolist() == [20, 23, 8, 11, 36, 39]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_then_unpack_into_another_block_table_is_bitwise_equal(dtype):
    bs, hkv, d = 4, 2, 8
    src = _cache(3, 8, bs, hkv, d, seed=0, dtype=dtype)
    dst = _cache(3, 10, bs, hkv, d, dtype=dtype)
    src_table = torch.tensor([3, 0, 6, 1, 7], dtype=torch.int32)
    dst_table = torch.tensor([9, 4, 2, 8, 5], dtype=torch.int32)
    # two zigzag pieces of a 20-token prompt, layers 0 and 2 only
    positions = torch.cat([torch.arange(1, 6), torch.arange(14, 19)])
    packed = pack_kv(src, src_table, positions, [0, 2])
    assert packed.shape == (2, 10, 2, hkv, d)
    assert packed.numel() * packed.element_size() == 2 * 10 * packed_bytes_per_token(hkv, d, dtype)
    unpack_kv(dst, dst_table, positions, [0, 2], packed)

    src_slots = positions_to_slots(src_table, positions, bs)
    dst_slots = positions_to_slots(dst_table, positions, bs)
    for layer in (0, 2):
        for which in (0, 1):
            s = src[layer][which].view(-1, hkv, d)[src_slots]
            t = dst[layer][which].view(-1, hkv, d)[dst_slots]
            assert torch.equal(s, t)
    # nothing else was written: layer 1 and every other slot stay zero
    assert not dst[1][0].any() and not dst[1][1].any()
    mask = torch.ones(10 * bs, dtype=torch.bool)
    mask[dst_slots] = False
    assert not dst[0][0].view(-1, hkv, d)[mask].any()
    assert torch.equal(pack_kv(dst, dst_table, positions, [0, 2]), packed)


def test_pack_rejects_positions_past_the_block_table_and_wrong_dtype():
    cache = _cache(1, 4, 4, 1, 2, seed=1)
    table = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="block table has 2 blocks"):
        pack_kv(cache, table, torch.tensor([8]), [0])
    packed = pack_kv(cache, table, torch.tensor([1, 2]), [0])
    with pytest.raises(ValueError, match="dtype"):
        unpack_kv(cache, table, torch.tensor([1, 2]), [0], packed.to(torch.float64))


def test_scatter_into_a_meta_cache_checks_the_piece_and_writes_nothing():
    """The emulated decode side's cache is meta tensors (no memory): a piece is still checked
    against the cache's geometry, and nothing runs to store it."""
    from tetris.kernels.kv_pack import scatter_kv

    k = torch.empty(4, 16, 8, 1, dtype=torch.bfloat16, device="meta")
    v = torch.empty_like(k)
    slots = torch.arange(3, 8)
    scatter_kv(k, v, slots, torch.zeros(5, 2, 8, 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="packed KV must be"):
        scatter_kv(k, v, slots, torch.zeros(5, 2, 8, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        scatter_kv(k, v, slots, torch.zeros(5, 2, 8, 1, dtype=torch.float32))
    # a real cache is still written
    kr, vr = torch.zeros(4, 16, 8, 1), torch.zeros(4, 16, 8, 1)
    scatter_kv(kr, vr, slots, torch.ones(5, 2, 8, 1))
    assert kr.view(-1, 8, 1)[3:8].eq(1).all() and kr.sum() == 5 * 8 and vr.sum() == 5 * 8
