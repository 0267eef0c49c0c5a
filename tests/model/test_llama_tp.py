"""Tensor parallelism: TP=2 over gloo in two processes gives the logits of TP=1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoints import make_hf_checkpoint
from tetris.config import ModelConfig
from tetris.kernels.attention import attention_with_lse
from tetris.model.llama import LlamaModel
from tetris.model.loader import load_model

DUMMY = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, seed=11)


def _causal(i, q, k, v):
    return attention_with_lse(q, k, v, causal=True)[0]


def _logits(cfg: ModelConfig, tp_group=None) -> torch.Tensor:
    model, _ = load_model(cfg, tp_group=tp_group)
    ids = torch.arange(24) * 7 % cfg.vocab_size
    return model.logits(model(ids, torch.arange(24), _causal)), model


def _worker(rank: int, store_path: str, out_dir: str, configs: list[ModelConfig]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        for n, cfg in enumerate(configs):
            logits, model = _logits(cfg, tp_group=dist.group.WORLD)
            assert model.local_num_heads * 2 == model.cfg.num_heads  # heads really split
            torch.save(logits, os.path.join(out_dir, f"cfg{n}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_logits_equal_tp1(tmp_path):
    hf = make_hf_checkpoint(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    configs = [DUMMY, ModelConfig(source="hf", path=str(hf))]
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path), configs), nprocs=2)
    for n, cfg in enumerate(configs):
        want, _ = _logits(cfg)
        for rank in range(2):
            got = torch.load(tmp_path / f"cfg{n}-rank{rank}.pt")
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_heads_not_divisible_by_tp_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("tetris.model.llama.tp_rank_size", lambda group: (0, 4))
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=8, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\) is not divisible by the tensor-parallel size 4"):
        LlamaModel(cfg, tp_group=object())
