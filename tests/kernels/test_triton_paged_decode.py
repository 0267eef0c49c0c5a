"""Triton split-K paged decode attention (kernels/triton_paged_decode.py) against torch references."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
tpd = pytest.importorskip("tetris.kernels.triton_paged_decode")
from tetris.kernels import triton_attention as ta  # noqa: E402

if not ta.INTERPRETED and not torch.cuda.is_available():
    pytest.skip("triton kernels need CUDA or TRITON_INTERPRET=1 at import", allow_module_level=True)

DEVICE = "cpu" if ta.INTERPRETED else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _paged_batch(context_lens, *, hq=4, hkv=2, d=32, page=8, maxb=None, dtype=torch.float32, seed=0):
    """Random caches and a block table that scatters each sequence over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + page - 1) // page for n in context_lens]
    maxb = maxb or max(max(need), 1)
    num_blocks = sum(need) + 3  # spare blocks hold noise that must never be read
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(context_lens), maxb, dtype=torch.int32)
    for i, nb in enumerate(need):
        table[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    q = torch.randn(len(context_lens), hq, d, generator=g).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, table, lens)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_split_k_matches_reference(dtype):
    args = _paged_batch([37, 5, 64, 16], dtype=dtype)
    got = tpd.paged_decode_attention(*args, partition_size=16)  # 4 partitions: exercises the reduce
    want = tpd.paged_decode_attention_reference(*args)
    assert got.dtype == dtype and got.shape == (4, 4, 32)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_partition_size_does_not_change_the_result():
    args = _paged_batch([50, 23], hq=6, hkv=2, d=16, page=4)
    one = tpd.paged_decode_attention(*args)  # default partition: a single partition here
    split = tpd.paged_decode_attention(*args, partition_size=16)
    torch.testing.assert_close(one, split, atol=1e-5, rtol=1e-5)


def test_equals_attention_over_the_gathered_context():
    """Decode of the last token == the attention step's causal row for that token."""
    q, k_cache, v_cache, table, lens = _paged_batch([29], hq=2, hkv=1, d=16, page=8)
    n = int(lens[0])
    tokens = torch.arange(n, device=DEVICE)
    blocks = table[0, tokens // 8].long()
    k = k_cache[blocks, tokens % 8]
    v = v_cache[blocks, tokens % 8]
    out, _ = ta.attention_with_lse_reference(q, k, v)
    got = tpd.paged_decode_attention(q, k_cache, v_cache, table, lens, partition_size=16)
    torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)


def test_agrees_with_torch_paged_decode():
    torch_pd = pytest.importorskip("tetris.kernels.paged_decode")
    args = _paged_batch([17, 40], hq=4, hkv=1, d=16, page=16)
    torch.testing.assert_close(tpd.paged_decode_attention(*args, partition_size=16),
                               torch_pd.paged_decode_attention(*args), atol=1e-5, rtol=1e-5)


def test_empty_context_gives_zeros_and_scale_is_used():
    q, k_cache, v_cache, table, lens = _paged_batch([0, 12], maxb=3)
    got = tpd.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.05, partition_size=16)
    assert (got[0] == 0).all()
    want = tpd.paged_decode_attention_reference(q, k_cache, v_cache, table, lens, 0.05)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    default = tpd.paged_decode_attention(q, k_cache, v_cache, table, lens, partition_size=16)
    assert not torch.allclose(default[1], got[1], atol=1e-3)


def test_bad_inputs_raise_value_error():
    q, k_cache, v_cache, table, lens = _paged_batch([10, 3], page=8, maxb=2)
    with pytest.raises(ValueError, match="power of two"):
        tpd.paged_decode_attention(q, k_cache[:, :6].contiguous(), v_cache[:, :6].contiguous(), table, lens)
    with pytest.raises(ValueError, match="int32"):
        tpd.paged_decode_attention(q, k_cache, v_cache, table.long(), lens)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        tpd.paged_decode_attention(q[:, :3].contiguous(), k_cache, v_cache, table, lens)
    with pytest.raises(ValueError, match="MAXB"):
        tpd.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([17, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="partition_size"):
        tpd.paged_decode_attention(q, k_cache, v_cache, table, lens, partition_size=24)
    with pytest.raises(ValueError, match="dtypes"):
        tpd.paged_decode_attention(q.half(), k_cache, v_cache, table, lens)
