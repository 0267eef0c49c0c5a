"""Triton KV pack/unpack (kernels/triton_kv_pack.py) against the torch references."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
tkp = pytest.importorskip("tetris.kernels.triton_kv_pack")
from tetris.kernels import kv_pack  # noqa: E402
from tetris.kernels import triton_attention as ta  # noqa: E402

if not ta.INTERPRETED and not torch.cuda.is_available():
    pytest.skip("triton kernels need CUDA or TRITON_INTERPRET=1 at import", allow_module_level=True)

DEVICE = "cpu" if ta.INTERPRETED else "cuda"


def _caches(layers=3, nb=6, page=4, hkv=2, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(nb, page, hkv, d, generator=g).to(dtype).to(DEVICE),
             torch.randn(nb, page, hkv, d, generator=g).to(dtype).to(DEVICE)) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_matches_reference_and_torch_path(dtype):
    caches = _caches(dtype=dtype)
    table = torch.tensor([4, 1, 5, 0], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([2, 3, 4, 5, 6, 13, 14, 15, 9], device=DEVICE)  # crosses blocks, out of order
    got = tkp.pack_kv(caches, table, positions, [2, 0])
    assert got.shape == (2, 9, 2, 2, 8) and got.dtype == dtype
    assert torch.equal(got, tkp.pack_kv_reference(caches, table, positions, [2, 0]))
    assert torch.equal(got, kv_pack.pack_kv(caches, table, positions, [2, 0]))


def test_unpack_round_trip_into_other_blocks():
    src = _caches(seed=1)
    dst = _caches(seed=2)
    before = [(k.clone(), v.clone()) for k, v in dst]
    positions = torch.arange(3, 14, device=DEVICE)  # 11 tokens over blocks 0..3 of the table
    src_table = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    dst_table = torch.tensor([5, 3, 1, 4], dtype=torch.int32, device=DEVICE)
    packed = tkp.pack_kv(src, src_table, positions, [0, 1, 2])
    tkp.unpack_kv(dst, dst_table, positions, [0, 1, 2], packed)
    assert torch.equal(tkp.pack_kv(dst, dst_table, positions, [0, 1, 2]), packed)
    # Slots outside the written positions keep their old values.
    written = kv_pack.positions_to_slots(dst_table, positions, 4)
    untouched = torch.ones(6 * 4, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    for (k, v), (k0, v0) in zip(dst, before):
        assert torch.equal(k.view(24, 2, 8)[untouched], k0.view(24, 2, 8)[untouched])
        assert torch.equal(v.view(24, 2, 8)[untouched], v0.view(24, 2, 8)[untouched])


def test_unpack_matches_torch_path():
    src = _caches(layers=1, seed=3)
    a, b = _caches(layers=1, seed=4), _caches(layers=1, seed=4)
    table = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([0, 1, 2, 5, 7], device=DEVICE)
    packed = tkp.pack_kv(src, table, positions, [0])
    tkp.unpack_kv(a, table, positions, [0], packed)
    kv_pack.unpack_kv(b, table, positions, [0], packed)
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[0][1], b[0][1])


def test_bad_inputs_raise_value_error():
    caches = _caches(layers=2)
    table = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(5, device=DEVICE)
    with pytest.raises(ValueError, match="block table"):
        tkp.pack_kv(caches, table, torch.arange(12, device=DEVICE), [0])
    with pytest.raises(ValueError, match="out of range"):
        tkp.pack_kv(caches, table, pos, [2])
    with pytest.raises(ValueError, match="packed KV must be"):
        tkp.unpack_kv(caches, table, pos, [0, 1], torch.zeros(2, 4, 2, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="packed KV is"):
        tkp.unpack_kv(caches, table, pos, [0], torch.zeros(1, 5, 2, 2, 8, dtype=torch.float16, device=DEVICE))
    mixed = [caches[0], (caches[1][0].half(), caches[1][1].half())]
    with pytest.raises(ValueError, match="layers differ"):
        tkp.pack_kv(mixed, table, pos, [0, 1])


def test_single_layer_gather_scatter_match_torch_path():
    (k, v), = _caches(layers=1, seed=6)
    slots = torch.tensor([23, 0, 5, 6, 17], device=DEVICE)
    got = tkp.gather_kv(k, v, slots)
    assert torch.equal(got, kv_pack.gather_kv(k, v, slots))
    (k2, v2), = _caches(layers=1, seed=7)
    (k3, v3) = (k2.clone(), v2.clone())
    tkp.scatter_kv(k2, v2, slots, got)
    kv_pack.scatter_kv(k3, v3, slots, got)
    assert torch.equal(k2, k3) and torch.equal(v2, v3)
    with pytest.raises(ValueError, match="packed KV must be"):
        tkp.scatter_kv(k2, v2, slots[:3], got)
