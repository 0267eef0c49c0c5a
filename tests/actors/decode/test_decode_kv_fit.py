"""``decode.kv_blocks = 0``: a decode rank takes every KV block its GPU holds after the weights,
the TP ranks of an instance agree on the least, and the instance reports that count to the
pool server the dispatcher plans with (docs/gpu.md). No GPU here: the CUDA branch runs with
the GPU's total memory faked (``torch.cuda.mem_get_info``), the models and weights real."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tetris.config import DecodeConfig, DeploymentConfig, ModelConfig
from tetris.device import kv_blocks_that_fit

MODEL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, seed=5)
BS = 4
UTIL = 0.9
MIB = 1 << 20
# fake GPU totals, one per rank: small, so that what fits is a few hundred blocks
TOTALS = (1 * MIB, 3 * MIB // 4)


def _fit(total: int, weights: int, block: int) -> int:
    return kv_blocks_that_fit(total_bytes=total, utilization=UTIL, weight_bytes=weights,
                              reserve_bytes=0.0, block_bytes=block)


def _fake_gpu(monkeypatch, totals):
    """``mem_get_info`` answers the next of ``totals`` on each call."""
    left = list(totals)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, left.pop(0)))


def test_zero_blocks_is_a_model_setting_only():
    assert DecodeConfig(kv_blocks=0).kv_blocks == 0
    with pytest.raises(ValueError, match="decode.kv_blocks must be positive, or 0"):
        DecodeConfig(kv_blocks=0, executor="emulated")
    with pytest.raises(ValueError, match="decode.kv_blocks must be positive"):
        DecodeConfig(kv_blocks=-1)


def _tp_worker(rank: int, port: int, out: str) -> None:
    from tetris.actors.device import decode_kv_blocks, weight_bytes

    from tetris.engine.kv_cache import kv_bytes_per_block
    from tetris.model.llama import LlamaModel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        model = LlamaModel(MODEL, tp_group=dist.group.WORLD)
        torch.cuda.current_device = lambda: 0
        torch.cuda.mem_get_info = lambda device=None: (0, TOTALS[rank])
        fit0 = DecodeConfig(tp_size=2, kv_blocks=0, block_size=BS, gpu_memory_utilization=UTIL,
                            activation_reserve_gib=0.0, gpus_per_rank=1.0)
        block = kv_bytes_per_block(model.num_layers, BS, model.local_num_kv_heads,
                                   model.head_dim, model.dtype)
        got = {"rank": rank, "weights": weight_bytes(model), "block": block,
               "fit": decode_kv_blocks(fit0, model, "cuda"),
               "explicit": decode_kv_blocks(
                   DecodeConfig(tp_size=2, kv_blocks=7, block_size=BS,
                                gpu_memory_utilization=UTIL, activation_reserve_gib=0.0,
                                gpus_per_rank=1.0), model, "cuda")}
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_tp_ranks_take_the_least_that_fits_any_of_them(tmp_path):
    from tetris.actors.prefill.world import free_port

    mp.spawn(_tp_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    own = [_fit(TOTALS[r["rank"]], r["weights"], r["block"]) for r in ranks]
    assert own[0] > own[1] > 0    # each GPU alone would hold a different count
    assert [r["fit"] for r in ranks] == [min(own)] * 2
    assert [r["explicit"] for r in ranks] == [7, 7]   # a configured count is only checked


class _Handle:
    """A rank in this process, called as a Ray actor handle is (``h.stats.remote()``)."""

    def __init__(self, rank) -> None:
        async def stats():
            return rank.stats()
        self.stats = SimpleNamespace(remote=stats)


def test_instance_reports_what_its_ranks_allocated(monkeypatch):
    import tetris.actors.device as device_mod
    from tetris.actors.decode.rank import DecodeRank
    from tetris.actors.device import weight_bytes

    from tetris.engine.kv_cache import kv_bytes_per_block
    from tetris.serve.pools import DecodePoolServer

    deployment = DeploymentConfig(model=MODEL, decode=DecodeConfig(
        num_instances=2, tp_size=1, max_batch_size=4, block_size=BS, kv_blocks=0,
        gpu_memory_utilization=UTIL, activation_reserve_gib=0.0, gpus_per_rank=1.0))
    sized_on_cuda = device_mod.decode_kv_blocks
    # the rank runs on the CPU here; only its KV sizing takes the CUDA branch, on a fake GPU
    monkeypatch.setattr(device_mod, "decode_kv_blocks",
                        lambda dc, model, device: sized_on_cuda(dc, model, "cuda"))
    _fake_gpu(monkeypatch, TOTALS + TOTALS[:1])
    ranks = [DecodeRank(i, 0, 1, deployment) for i in range(3)]
    for r in ranks:
        r.init_group("127.0.0.1", 0, 5.0)
    model = ranks[0].engine.model
    block = kv_bytes_per_block(model.num_layers, BS, model.local_num_kv_heads, model.head_dim,
                               model.dtype)
    want = [_fit(t, weight_bytes(model), block) for t in TOTALS + TOTALS[:1]]
    assert [r.engine.cache.num_blocks for r in ranks] == want and want[0] != want[1]

    pool = DecodePoolServer.func_or_class(deployment)
    assert asyncio.run(pool.kv_capacities()) == [0, 0]    # nothing reported before start
    pool.instances[0].ranks = [_Handle(ranks[0]), _Handle(ranks[1])]   # a TP-2 instance
    pool.instances[1].ranks = [_Handle(ranks[2])]

    async def report():
        for inst in pool.instances:
            await inst._read_kv_blocks()
        return await pool.kv_capacities()

    assert asyncio.run(report()) == [min(want[:2]) * BS, want[2] * BS]
