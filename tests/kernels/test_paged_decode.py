"""Paged decode attention and write_kv against contiguous attention over the same tokens."""

from __future__ import annotations

import pytest
import torch

from tetris.kernels import dispatch
from tetris.kernels.attention import attention_with_lse_ref
from tetris.kernels.paged_decode import (
    paged_decode_attention,
    paged_decode_attention_with_lse,
    write_kv,
)

NB, BS, HQ, HKV, D = 24, 4, 4, 2, 8


def _scatter_sequences(context_lens, seed):
    """Random K/V per sequence written into randomly chosen, shuffled blocks of one cache."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NB, BS, HKV, D, generator=g)  # garbage where nothing is written
    v_cache = torch.randn(NB, BS, HKV, D, generator=g)
    free = torch.randperm(NB, generator=g).tolist()
    maxb = max(1, max(-(-n // BS) for n in context_lens))
    tables = torch.full((len(context_lens), maxb), NB - 1, dtype=torch.int32)
    seqs = []
    for b, n in enumerate(context_lens):
        blocks = [free.pop() for _ in range(-(-n // BS))]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, HKV, D, generator=g)
        v = torch.randn(n, HKV, D, generator=g)
        pos = torch.arange(n)
        slots = torch.tensor(blocks, dtype=torch.int64)[pos // BS] * BS + pos % BS
        write_kv(k_cache, v_cache, k, v, slots)
        seqs.append((k, v))
    return k_cache, v_cache, tables, seqs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_decode_equals_contiguous_attention(seed):
    g = torch.Generator().manual_seed(100 + seed)
    context_lens = torch.randint(1, 20, (5,), generator=g).tolist()
    k_cache, v_cache, tables, seqs = _scatter_sequences(context_lens, seed)
    q = torch.randn(len(context_lens), HQ, D, generator=g)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    for fn in (paged_decode_attention, dispatch.paged_decode_attention):
        out = fn(q, k_cache, v_cache, tables, lens)
        for b, (k, v) in enumerate(seqs):
            ref, _ = attention_with_lse_ref(q[b:b + 1], k, v)
            torch.testing.assert_close(out[b], ref[0], atol=1e-5, rtol=1e-5)
    _, lse = paged_decode_attention_with_lse(q, k_cache, v_cache, tables, lens)
    for b, (k, v) in enumerate(seqs):
        _, ref_lse = attention_with_lse_ref(q[b:b + 1], k, v)
        torch.testing.assert_close(lse[b], ref_lse[:, 0], atol=1e-5, rtol=1e-5)


def test_zero_context_gives_zero_output_and_bf16_cache():
    k_cache, v_cache, tables, seqs = _scatter_sequences([5, 0], seed=7)
    q = torch.randn(2, HQ, D)
    out, lse = paged_decode_attention_with_lse(
        q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables, torch.tensor([5, 0]))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[1], torch.zeros(HQ, D, dtype=torch.bfloat16))
    assert torch.isneginf(lse[1]).all()
    ref, _ = attention_with_lse_ref(q[:1], *seqs[0])
    torch.testing.assert_close(out[0].float(), ref[0], atol=3e-2, rtol=3e-2)


def test_write_kv_places_tokens_at_slots():
    k_cache = torch.zeros(2, BS, HKV, D)
    v_cache = torch.zeros(2, BS, HKV, D)
    k = torch.arange(3 * HKV * D, dtype=torch.float32).view(3, HKV, D)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([5, 0, 7]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(k_cache[0, 0], k[1])
    assert torch.equal(v_cache[1, 3], -k[2])
    assert k_cache.abs().sum() == k.abs().sum()


def test_errors_are_clear():
    k_cache = torch.zeros(2, BS, HKV, D)
    with pytest.raises(ValueError, match="outside"):
        write_kv(k_cache, k_cache.clone(), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D),
                 torch.tensor([8]))
    with pytest.raises(ValueError, match="capacity"):
        paged_decode_attention(torch.zeros(1, HQ, D), k_cache, k_cache,
                               torch.zeros(1, 1, dtype=torch.int32), torch.tensor([BS + 1]))
    with pytest.raises(ValueError, match="do not fit"):
        paged_decode_attention(torch.zeros(1, 3, D), k_cache, k_cache,
                               torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]))


def test_sdpa_path_equals_lse_path_and_meta_is_shared_across_layers():
    """The batched-SDPA output equals the LSE path's, GQA groups and empty rows included, and
    one step's DecodeMeta serves caches of different layers."""
    from tetris.kernels.paged_decode import decode_meta, paged_decode_attention_meta

    lens = [7, 0, 13, 1, 4]
    k_cache, v_cache, tables, _ = _scatter_sequences(lens, seed=3)
    g = torch.Generator().manual_seed(4)
    # A strided q (a slice of a wider buffer), as the model's fused projection hands it over.
    q = torch.randn(len(lens), HQ + HKV, D, generator=g)[:, :HQ]
    context = torch.tensor(lens, dtype=torch.int32)
    meta = decode_meta(tables, context, BS, NB, max(lens))
    assert meta.empty is not None and meta.empty.tolist() == [n == 0 for n in lens]
    for kc, vc in ((k_cache, v_cache), (v_cache * 0.5, k_cache * 2.0)):  # two "layers"
        want, _ = paged_decode_attention_with_lse(q, kc, vc, tables, context)
        torch.testing.assert_close(paged_decode_attention_meta(q, kc, vc, meta), want,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(paged_decode_attention(q, kc, vc, tables, context), want,
                                   atol=1e-5, rtol=1e-5)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, tables, context)[1],
                       torch.zeros(HQ, D))
    full = decode_meta(tables, context + 1, BS, NB, max(lens) + 1)
    assert full.empty is None  # no empty row: no masking pass


def test_write_kv_without_bounds_check_writes_the_same():
    k = torch.randn(3, HKV, D, generator=torch.Generator().manual_seed(9))
    slots = torch.tensor([5, 0, 7])
    checked = [torch.zeros(2, BS, HKV, D) for _ in range(2)]
    unchecked = [torch.zeros(2, BS, HKV, D) for _ in range(2)]
    write_kv(*checked, k, 2 * k, slots)
    write_kv(*unchecked, k, 2 * k, slots, check_bounds=False)
    assert all(torch.equal(a, b) for a, b in zip(checked, unchecked, strict=True))
    with pytest.raises(ValueError, match="outside"):
        write_kv(*checked, k[:1], k[:1], torch.tensor([-1]))
