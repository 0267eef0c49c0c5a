"""Device and KV memory rules on a real GPU (docs/gpu.md, issue #22 item 1). Skipped without
CUDA. Outside Ray ``device = "auto"`` stays on the CPU, so these ask for "cuda"."""

from __future__ import annotations

import pytest
import torch

from tetris.config import DecodeConfig, DeploymentConfig, ModelConfig
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


def test_a_decode_rank_sizes_against_the_real_gpu():
    from tetris.actors.decode.rank import DecodeRank
    from tetris.actors.device import weight_bytes

    ok = DeploymentConfig(model=ModelConfig(num_layers=2, device="cuda"),
                          decode=DecodeConfig(tp_size=1, kv_blocks=64, block_size=16))
    rank = DecodeRank(0, 0, 1, ok)
    rank.init_group("127.0.0.1", 0, 5.0)
    cache = rank.engine.cache
    assert (cache.buffer.device.type, cache.buffer.dtype, cache.num_blocks) == (
        "cuda", torch.bfloat16, 64)
    _free, total = torch.cuda.mem_get_info()
    block = 2 * 2 * 16 * 2 * 32 * 2   # K and V, 2 layers, 16 tokens, 2 KV heads, D 32, bf16
    fit = kv_blocks_that_fit(total_bytes=total, utilization=0.9,
                             weight_bytes=weight_bytes(rank.engine.model),
                             reserve_bytes=2 * GIB, block_bytes=block)
    too_many = DeploymentConfig(model=ModelConfig(num_layers=2, device="cuda"),
                                decode=DecodeConfig(tp_size=1, kv_blocks=fit + 1, block_size=16))
    with pytest.raises(KVMemoryError, match=f"decode.kv_blocks = {fit + 1} blocks .* holds {fit};"):
        DecodeRank(0, 0, 1, too_many).init_group("127.0.0.1", 0, 5.0)
