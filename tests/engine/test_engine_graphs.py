"""CUDA-graph dispatch in the engine, on CPU: ``cuda_graphs=True`` off CUDA runs the padded
static-buffer path eagerly, so which steps take it, the padding and the fallback are tested
here; real capture is tested in tests/gpu/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import tiny_model
from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 300, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _engine(**kw) -> LLMEngine:
    model, _ = tiny_model()
    return LLMEngine(model, None, num_blocks=40, block_size=4, max_num_seqs=8, **kw)


def _spy(engine: LLMEngine) -> list[int]:
    """Record the batch size the graph runner's step runs at (the bucket, padding included)."""
    graphs = engine.runner.graphs
    sizes: list[int] = []
    step = graphs.step

    def recording(**tensors):
        sizes.append(tensors["input_ids"].shape[0])
        return step(**tensors)

    graphs.step = recording
    return sizes


def test_graphs_default_off_on_cpu():
    engine = _engine()
    assert engine.runner.graphs is None
    assert engine.stats().total_blocks == 40


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_padded_graph_path_gives_eager_tokens(batch):
    prompts = _prompts(batch)
    want = [o.token_ids for o in _engine(cuda_graphs=False).generate(prompts, GREEDY)]
    engine = _engine(cuda_graphs=True, graph_batch_sizes=[1, 2, 4])
    sizes = _spy(engine)
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == want
    # The first step prefills (eager); the 5 decode steps each ran at the padded bucket size.
    bucket = engine.runner.graphs.bucket_for(batch)
    assert sizes == [bucket] * 5
    assert engine.runner.graph_steps == 5 and engine.runner.eager_steps == 0
    # Padding rows wrote only to the scratch block, which no sequence got.
    assert engine.stats().total_blocks == 39 and engine.num_free_blocks == 39


def test_oversize_and_mixed_batches_run_eagerly():
    prompts = _prompts(6)
    want = [o.token_ids for o in _engine(cuda_graphs=False).generate(prompts, GREEDY)]
    engine = _engine(cuda_graphs=True, graph_batch_sizes=[2, 4])
    sizes = _spy(engine)
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == want
    assert sizes == [] and engine.runner.eager_steps == 5  # 6 rows fit no bucket
    # A request joining mid-stream makes one mixed step (eager); the rest fit bucket 2.
    engine = _engine(cuda_graphs=True, graph_batch_sizes=[2, 4])
    sizes = _spy(engine)
    engine.add_request("a", prompts[0], GREEDY)
    engine.step()  # prefill of "a"
    engine.step()  # "a" decodes alone: bucket 2 (one padding row)
    engine.add_request("b", prompts[1], GREEDY)
    engine.step()  # "a" decodes while "b" prefills: mixed, eager
    assert sizes == [2]
    assert engine.runner.graph_steps == 1
    while engine.has_unfinished():
        engine.step()
    assert sizes[1:] and set(sizes[1:]) == {2}


def test_scratch_block_counts_against_capacity():
    model, _ = tiny_model()
    engine = LLMEngine(model, None, num_blocks=3, block_size=4, cuda_graphs=True)
    with pytest.raises(ValueError, match="holds only 8 tokens"):
        engine.add_request("x", list(range(3, 12)), GREEDY)  # 9 tokens + 1 > 2 blocks
