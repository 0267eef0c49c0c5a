"""An elastic decode master holds a request's positions from ``kv_start`` on (issue #25): its
engine admits a prompt longer than its whole KV cache when the part from ``kv_start`` fits
(the rest is held on other instances), and still refuses one whose part does not."""

from __future__ import annotations

import pytest
from engine_helpers import tiny_model

from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams

BS, BLOCKS = 4, 8        # 32 token slots in the whole cache
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _engine() -> LLMEngine:
    model, _ = tiny_model()
    return LLMEngine(model, None, num_blocks=BLOCKS, block_size=BS)


def test_a_master_reserves_only_its_range_of_a_prompt_bigger_than_its_cache():
    engine = _engine()
    prompt = [7] * 50                        # more than the whole cache
    with pytest.raises(ValueError, match="holds only"):
        engine.reserve_blocks("whole", prompt, PARAMS)
    table = engine.reserve_blocks("master", prompt, PARAMS, kv_start=30)
    # positions [30, 50): 20 / 4 blocks, nothing for [0, 30)
    assert len(table) == 5, table
    seq = engine._seqs["master"]
    assert seq.kv_start == 30
    # it may grow to a whole cache's worth past kv_start, not 30 tokens less
    assert seq.max_total_tokens == 30 + engine._usable_blocks * BS


def test_a_master_whose_range_exceeds_the_cache_is_refused():
    engine = _engine()
    with pytest.raises(ValueError, match=r"\(40 from position 10 on\) but the KV cache holds only"):
        engine.reserve_blocks("master", [7] * 50, PARAMS, kv_start=10)
    assert engine.blocks.num_free_blocks == engine._usable_blocks
