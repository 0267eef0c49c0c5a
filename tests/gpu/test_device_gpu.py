"""Device and KV memory rules on a real GPU (docs/gpu.md, issue #22 item 1). Skipped without
CUDA. Outside Ray ``device = "auto"`` stays on the CPU, so these ask for "cuda"."""

from __future__ import annotations

import pytest
import torch

from tetris.config import DecodeConfig, ModelConfig
from tetris.device import GIB, KVMemoryError, kv_blocks_that_fit

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_takes_bfloat16_and_auto_outside_ray_the_cpu():
    from tetris.actors.device import actor_device, load_model_on_device

    assert actor_device(ModelConfig())[0] == "cpu"
    device, cfg = actor_device(ModelConfig(device="cuda"))
    assert (device, cfg.dtype) == ("cuda", "bfloat16")
    model, _tok, device = load_model_on_device(ModelConfig(num_layers=2, device="cuda"))
    weight = next(model.parameters())
    assert (weight.device.type, weight.dtype) == ("cuda", torch.bfloat16)


def test_a_decode_rank_sizes_its_kv_against_the_real_gpu():
    """What a decode rank does at start (actors/device.py, without Ray): the configured block
    count is checked against this GPU's memory; one block more than fits fails with the count
    that fits; 0 takes every block that fits."""
    from tetris.actors.device import decode_kv_blocks, load_model_on_device, weight_bytes
    from tetris.engine.engine import LLMEngine

    model, _tok, device = load_model_on_device(ModelConfig(num_layers=2, device="cuda"))
    assert device == "cuda"
    dc = DecodeConfig(tp_size=1, kv_blocks=64, block_size=16)
    assert decode_kv_blocks(dc, model, device) == 64
    engine = LLMEngine(model, None, num_blocks=64, block_size=16)
    assert (engine.cache.buffer.device.type, engine.cache.buffer.dtype) == ("cuda", torch.bfloat16)
    _free, total = torch.cuda.mem_get_info()
    block = 2 * 2 * 16 * 2 * 32 * 2   # K and V, 2 layers, 16 tokens, 2 KV heads, D 32, bf16
    fit = kv_blocks_that_fit(total_bytes=total, utilization=0.9, weight_bytes=weight_bytes(model),
                             reserve_bytes=2 * GIB, block_bytes=block)
    too_many = DecodeConfig(tp_size=1, kv_blocks=fit + 1, block_size=16)
    with pytest.raises(KVMemoryError, match=f"decode.kv_blocks = {fit + 1} blocks .* holds {fit};"):
        decode_kv_blocks(too_many, model, device)
    assert decode_kv_blocks(DecodeConfig(tp_size=1, kv_blocks=0, block_size=16), model,
                            device) == fit
