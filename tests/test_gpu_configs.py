"""The GPU deployments (configs/llama3-*-gpu.toml) load, add up to their nodes' GPUs, place
on them, and their decode KV fits an 80 GB GPU; ``tetris serve`` refuses them without CUDA."""

from __future__ import annotations

import pytest

from tetris.config import ModelConfig, load_deployment
from tetris.device import GIB, KVMemoryError, check_kv_blocks, deployment_gpus

GPUS_PER_NODE = 8
GPU_80GB = 79.1 * GIB      # what torch.cuda.mem_get_info reports as an 80 GB A100/H100's total
GPU_40GB = 39.4 * GIB

# The checkpoints' architecture (their config.json); the configs name only a directory.
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, dtype="bfloat16")
LLAMA3_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                         num_layers=80, num_heads=64, num_kv_heads=8, dtype="bfloat16")

DEPLOYMENTS = [  # file, nodes, geometry, (prefill TP, decode TP, decode instances)
    ("llama3-8b-1node-gpu.toml", 1, LLAMA3_8B, (1, 2, 1)),
    ("llama3-70b-2node-gpu.toml", 2, LLAMA3_70B, (4, 4, 2)),
]


def _pack(groups: list[float], nodes: int) -> list[float]:
    """First-fit-decreasing of GPU groups that may not span a node; each node's GPUs used."""
    used = [0.0] * nodes
    for g in sorted(groups, reverse=True):
        fit = next((n for n in range(nodes) if used[n] + g <= GPUS_PER_NODE), None)
        assert fit is not None, f"a group of {g} GPUs does not fit beside {used}"
        used[fit] += g
    return used


@pytest.mark.parametrize("name, nodes, geometry, shape", DEPLOYMENTS)
def test_gpu_deployment_adds_up_to_its_nodes(name, nodes, geometry, shape):
    cfg = load_deployment(name)
    pc, dc = cfg.prefill, cfg.decode
    assert (cfg.model.device, cfg.model.dtype, cfg.model.source) == ("cuda", "auto", "hf")
    assert (pc.tp_size, dc.tp_size, dc.num_instances) == shape
    # one GPU per TP rank, from device = "cuda"
    assert (pc.gpus_per_instance, dc.gpus_per_rank) == (float(pc.tp_size), 1.0)
    assert deployment_gpus(cfg) == nodes * GPUS_PER_NODE
    # prefill instances and whole decode TP groups (STRICT_PACK) fill the nodes exactly
    groups = [pc.gpus_per_instance] * pc.num_instances + [dc.tp_size * dc.gpus_per_rank] * dc.num_instances
    assert _pack(groups, nodes) == [GPUS_PER_NODE] * nodes
    assert max(cfg.scheduler.sp_candidates) <= pc.num_instances
    assert cfg.transfer.pool_size == cfg.transfer.num_backends == pc.num_instances


def _decode_kv_check(name: str, geometry: ModelConfig, total_bytes: float) -> int:
    from tetris.actors.decode.emulated import decode_model_spec

    cfg = load_deployment(name)
    dc = cfg.decode
    spec = decode_model_spec(geometry)
    block = spec.kv_bytes_per_token / dc.tp_size * dc.block_size
    return check_kv_blocks(dc.kv_blocks, total_bytes=total_bytes,
                           utilization=dc.gpu_memory_utilization,
                           weight_bytes=spec.weight_bytes / dc.tp_size,
                           reserve_bytes=dc.activation_reserve_gib * GIB, block_bytes=block)


@pytest.mark.parametrize("name, nodes, geometry, shape", DEPLOYMENTS)
def test_decode_kv_blocks_fit_an_80gb_gpu(name, nodes, geometry, shape):
    assert _decode_kv_check(name, geometry, GPU_80GB) == load_deployment(name).decode.kv_blocks


def test_the_70b_deployment_on_40gb_gpus_fails_with_the_numbers():
    with pytest.raises(KVMemoryError, match=r"decode.kv_blocks = 24576 blocks of 1.25 MiB .* "
                                            r"0.9 x 39.40 GiB .* 32.85 GiB weights .* holds 496;"):
        _decode_kv_check("llama3-70b-2node-gpu.toml", LLAMA3_70B, GPU_40GB)


def test_serve_refuses_a_gpu_deployment_on_a_cluster_without_gpus(monkeypatch, capsys):
    import ray
    from tetris.actors.process_env import SERVE_ENV_VARS

    from tetris.cli.main import main

    for key in SERVE_ENV_VARS:   # run() sets them for the Ray it starts: undone after the test
        monkeypatch.delenv(key, raising=False)
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append("init"))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    assert main(["serve", "--config", "llama3-8b-1node-gpu.toml"]) == 2
    err = capsys.readouterr().err
    assert "asks for 8 GPUs (CUDA) but the Ray cluster has 0" in err
    assert calls == ["init", "shutdown"]


def test_the_gpu_layout_with_device_cpu_reserves_no_gpu(tmp_path):
    from tetris.config import default_deployment_path

    text = (default_deployment_path().parent / "llama3-8b-1node-gpu.toml").read_text()
    p = tmp_path / "cpu.toml"
    p.write_text(text.replace('device = "cuda"', 'device = "cpu"'))
    cfg = load_deployment(p)
    assert (cfg.prefill.gpus_per_instance, cfg.decode.gpus_per_rank) == (0.0, 0.0)
    assert deployment_gpus(cfg) == 0.0
