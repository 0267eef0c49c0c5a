"""DecodeGraphRunner capturing real CUDA graphs of a Triton paged-decode step.

Skipped without CUDA. Run with TRITON_INTERPRET=0 (the interpreter cannot be captured).
"""

from __future__ import annotations

import pytest
import torch

from tetris.engine.cuda_graphs import DecodeGraphRunner, StaticInput

pytest.importorskip("triton")
ta = pytest.importorskip("tetris.kernels.triton_attention")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(ta.INTERPRETED, reason="set TRITON_INTERPRET=0 to capture compiled kernels"),
]
HQ, HKV, D, PAGE, MAXB, NB = 32, 8, 128, 16, 64, 512


def _setup():
    from tetris.kernels.triton_paged_decode import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(NB, PAGE, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(NB, PAGE, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    proj = torch.randn(D, D, generator=g, device="cuda", dtype=torch.bfloat16) / D**0.5

    def step(q, block_tables, context_lens):
        # A projection then attention: a torch kernel and the two Triton kernels in one graph.
        return paged_decode_attention(q @ proj, k_cache, v_cache, block_tables, context_lens)

    inputs = [StaticInput("q", (HQ, D), "bfloat16"), StaticInput("block_tables", (MAXB,), "int32"),
              StaticInput("context_lens", (), "int32")]
    return step, inputs, g


def _batch(g, b):
    return {"q": torch.randn(b, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16),
            "block_tables": torch.randint(0, NB, (b, MAXB), generator=g, device="cuda", dtype=torch.int32),
            "context_lens": torch.randint(1, MAXB * PAGE + 1, (b,), generator=g, device="cuda",
                                          dtype=torch.int32)}


def test_replay_matches_eager_for_every_bucket():
    step, inputs, g = _setup()
    runner = DecodeGraphRunner(step, inputs, [1, 2, 4, 8, 16], "cuda")
    runner.capture_all()
    assert runner.captured() == [1, 2, 4, 8, 16]
    for b in (1, 3, 8, 11, 16, 2):
        batch = _batch(g, b)
        got = runner.run(**batch)
        torch.testing.assert_close(got.float(), step(**batch).float(), atol=2e-2, rtol=2e-2)


def test_replay_sees_new_inputs_and_oversize_runs_eagerly():
    step, inputs, g = _setup()
    runner = DecodeGraphRunner(step, inputs, [4], "cuda")
    a, b = _batch(g, 4), _batch(g, 4)
    out_a, out_b = runner.run(**a), runner.run(**b)
    assert not torch.allclose(out_a.float(), out_b.float())
    torch.testing.assert_close(out_a.float(), step(**a).float(), atol=2e-2, rtol=2e-2)
    big = _batch(g, 6)
    torch.testing.assert_close(runner.run(**big).float(), step(**big).float(), atol=2e-2, rtol=2e-2)
    assert runner.captured() == [4]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_engine_graph_replay_gives_eager_greedy_tokens(batch):
    """The engine's decode steps by graph replay produce the tokens of eager decoding."""
    from tetris.config import ModelConfig
    from tetris.engine.engine import LLMEngine
    from tetris.model.loader import load_model
    from tetris.sampling_params import SamplingParams

    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=8, num_kv_heads=2, max_position_embeddings=512, seed=3,
                      dtype="float32")
    # fp32: padded GEMMs may pick other kernels than the live batch's; in fp32 their rounding
    # differences are far too small to flip a greedy choice (in bf16 they might).
    model, _ = load_model(cfg, device="cuda")
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 500, (7 + 5 * i,), generator=gen).tolist() for i in range(batch)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        engine = LLMEngine(model, None, num_blocks=64, block_size=16, max_num_seqs=8,
                           cuda_graphs=graphs)
        outs[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        if graphs:
            assert engine.runner.graph_steps == 23 and engine.runner.eager_steps == 0
            assert engine.runner.graphs.captured() == [engine.runner.graphs.bucket_for(batch)]
    assert outs[True] == outs[False]
