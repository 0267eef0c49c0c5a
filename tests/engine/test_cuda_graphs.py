"""DecodeGraphRunner (tetris/engine/cuda_graphs.py) on CPU: bucketing, padding, eager fallback.

Graph capture itself needs CUDA and is tested in tests/gpu/test_cuda_graphs_gpu.py; here
`emulate=True` runs the same padded static-buffer path eagerly.
"""

from __future__ import annotations

import pytest
import torch

from tetris.engine.cuda_graphs import DecodeGraphRunner, StaticInput, default_batch_buckets
from tetris.kernels.paged_decode import paged_decode_attention

HQ, HKV, D, PAGE, MAXB = 4, 2, 16, 4, 3


@pytest.fixture
def decode_setup():
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(10, PAGE, HKV, D, generator=g)
    v_cache = torch.randn(10, PAGE, HKV, D, generator=g)
    seen: list[int] = []

    def step(q, block_tables, context_lens):
        seen.append(q.shape[0])
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens)

    inputs = [StaticInput("q", (HQ, D), "float32"),
              StaticInput("block_tables", (MAXB,), "int32"),
              StaticInput("context_lens", (), "int32")]
    return step, inputs, seen, g


def _batch(g, b):
    q = torch.randn(b, HQ, D, generator=g)
    tables = torch.randint(0, 10, (b, MAXB), generator=g, dtype=torch.int32)
    lens = torch.randint(1, MAXB * PAGE + 1, (b,), generator=g, dtype=torch.int32)
    return {"q": q, "block_tables": tables, "context_lens": lens}


def test_default_buckets():
    assert default_batch_buckets(1) == [1]
    assert default_batch_buckets(5) == [1, 2, 4, 5]
    assert default_batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert default_batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError):
        default_batch_buckets(0)


def test_emulated_buckets_pad_and_match_eager(decode_setup):
    step, inputs, seen, g = decode_setup
    runner = DecodeGraphRunner(step, inputs, [1, 4, 8], "cpu", emulate=True)
    assert runner.bucket_for(3) == 4 and runner.bucket_for(8) == 8 and runner.bucket_for(9) is None
    for b in (3, 1, 6, 4):
        batch = _batch(g, b)
        seen.clear()
        got = runner.run(**batch)
        assert seen == [runner.bucket_for(b)]  # the step ran on the padded bucket
        want = step(**batch)
        assert got.shape == (b, HQ, D)
        torch.testing.assert_close(got, want)
    # Padding rows have context 0 and came out as zeros inside the static run.
    assert (runner._buckets[8].buffers["context_lens"][6:] == 0).all()


def test_results_do_not_alias_static_output(decode_setup):
    step, inputs, _, g = decode_setup
    runner = DecodeGraphRunner(step, inputs, [4], "cpu", emulate=True)
    first_batch = _batch(g, 2)
    first = runner.run(**first_batch)
    kept = first.clone()
    runner.run(**_batch(g, 2))
    assert torch.equal(first, kept)


def test_off_gpu_without_emulation_and_oversize_batches_run_eagerly(decode_setup):
    step, inputs, seen, g = decode_setup
    runner = DecodeGraphRunner(step, inputs, [2, 4], "cpu")
    assert not runner.use_graphs and not runner.emulate
    seen.clear()
    runner.run(**_batch(g, 3))
    assert seen == [3]  # no padding off-GPU
    emulated = DecodeGraphRunner(step, inputs, [2, 4], "cpu", emulate=True)
    seen.clear()
    batch = _batch(g, 5)
    torch.testing.assert_close(emulated.run(**batch), step(**batch))
    assert seen[0] == 5 and emulated.captured() == []


def test_bad_inputs(decode_setup):
    step, inputs, _, g = decode_setup
    runner = DecodeGraphRunner(step, inputs, [4], "cpu", emulate=True)
    batch = _batch(g, 2)
    with pytest.raises(ValueError, match="inputs are"):
        runner.run(q=batch["q"], context_lens=batch["context_lens"])
    with pytest.raises(ValueError, match="leading batch dim"):
        runner.run(**{**batch, "context_lens": batch["context_lens"][:1]})
    with pytest.raises(ValueError, match="block_tables"):
        runner.run(**{**batch, "block_tables": batch["block_tables"].long()})
    with pytest.raises(ValueError, match="unknown torch dtype"):
        DecodeGraphRunner(step, [StaticInput("q", (1,), "floaty")], [1], "cpu")
    with pytest.raises(ValueError, match="positive"):
        DecodeGraphRunner(step, inputs, [0, 2], "cpu")
