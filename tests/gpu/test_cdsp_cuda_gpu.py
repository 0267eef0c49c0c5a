"""CDSP prefill with every ring step on CUDA tensors equals the single instance (issue #22).

The prefill instances are threads of this process (``actors/prefill/threaded.py``): one GPU
cannot hold an NCCL ring of several ranks, so the seam picks gloo and stages each block
through host memory (``actors/collectives.StagedLink``); attention, merges, KV stores and
balancing all run on the device. Skipped without CUDA.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from cdsp_check import check_plan, prompt
from tetris.actors.collectives import StagedLink
from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.threaded import ThreadedPool
from tetris.config import load_deployment
from tetris.kernels.dispatch import attention_backend_for
from tetris.model.loader import load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NODES = (0, 0, 1, 1)


def _model(dtype: str):
    cfg = msgspec.structs.replace(load_deployment("tiny-cpu.toml").model, dtype=dtype)
    return load_model(cfg, device="cuda")[0]


@pytest.fixture(scope="module")
def fp32():
    model = _model("float32")
    return model, ThreadedPool(model, 4, num_blocks=256, block_size=16, timeout_s=60.0)


@pytest.mark.parametrize("n,spec,balance", [
    (1024, "1024x1", "overlap"),
    (1500, "300x1,500x2,restx4", "overlap"),
    (1999, "333x2,777x3,restx4", "blocking"),
    (1500, "300x1,restx4", "off"),
])
def test_ring_steps_on_cuda_equal_the_single_instance_fp32(fp32, n, spec, balance):
    model, pool = fp32
    assert pool.backend == "gloo" and all(isinstance(w._link, StagedLink) for w in pool.links)
    assert all(s.k_cache[0].is_cuda for s in pool.stores)
    plan = forced_plan(f"cuda-{spec}-{balance}", n, spec, NODES)
    res = check_plan(pool, model, plan, prompt(n, n), rtol=1e-4, balance=balance)
    if balance != "off" and len(plan.chunks) > 1:
        assert res.balance_moved_tokens > 0
    pool.release(plan.request_id)
    assert all(not s.requests() for s in pool.stores)


def test_ring_steps_in_bf16_use_the_gpu_kernels_and_stay_close():
    """bf16: the serve-time kernels (flash-attn when importable, else torch's CUDA flash kernel
    for unmasked and diagonal steps, Triton for position masks) run the ring; the
    single instance runs the same kernels on the whole prompt. Rounding differs (pieces merge
    by LSE), so the check is a tolerance, plus the greedy token."""
    model = _model("bfloat16")
    q = torch.zeros(4, model.local_num_heads, model.head_dim, device="cuda", dtype=torch.bfloat16)
    assert attention_backend_for(q, q) in ("flash_attn", "cuda_flash")
    pool = ThreadedPool(model, 4, num_blocks=256, block_size=16, timeout_s=60.0)
    n = 2048
    plan = forced_plan("cuda-bf16", n, "512x1,512x2,restx4", NODES)
    check_plan(pool, model, plan, prompt(n, 5), rtol=3e-2)
    pool.release(plan.request_id)
