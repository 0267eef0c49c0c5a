"""TP-2 prefill instances on CUDA equal the single instance (issue #22 item 6), without Ray.

Two instances × TP 2 = four processes on the one GPU (``tp_processes.TPProcessPool``): each
joins its instance's TP group and its head slice's world through the collectives seam, loads
its model shard and KV store on CUDA and runs its chunks through ``ModelExecutor``, as a TP
prefill worker does. Four ranks on one GPU: the seam picks gloo (NCCL refuses two ranks on one
GPU), so the all-reduces run gloo on CUDA tensors and the ring's blocks are staged through host
memory. Skipped without CUDA.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from cdsp_check import check_plan, prompt
from tetris.actors.prefill.layout import forced_plan
from tetris.config import load_deployment
from tetris.model.loader import load_model
from tp_processes import TPProcessPool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NODES = (0, 1)


@pytest.fixture(scope="module")
def setup():
    cfg = msgspec.structs.replace(load_deployment("tiny-cpu.toml").model, dtype="float32")
    pool = TPProcessPool(cfg, 2, 2, "cuda")
    yield load_model(cfg, device="cuda")[0], pool
    pool.close()


@pytest.mark.parametrize("n,spec,balance", [
    (1024, "restx2", "overlap"),
    (1500, "500x1,restx2", "overlap"),
    (1500, "300x1,400x1,restx2", "blocking"),
    (1200, "500x1,restx2", "off"),
])
def test_tp2_instances_on_cuda_equal_the_single_instance(setup, n, spec, balance):
    model, pool = setup
    assert pool.backends == {"gloo"}
    plan = forced_plan(f"tp-cuda-{spec}-{balance}", n, spec, NODES)
    res = check_plan(pool, model, plan, prompt(n, n), rtol=1e-4, balance=balance)
    if balance != "off" and len(plan.chunks[-1].instances) > len(plan.chunks[0].instances):
        assert res.balance_moved_tokens > 0
