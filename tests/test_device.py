"""Device, dtype, GPUs per bundle and KV sizing (tetris/device.py, actors/device.py), on CPU."""

from __future__ import annotations

import pytest
import torch

from tetris.config import (
    ConfigError,
    DecodeConfig,
    DeploymentConfig,
    ModelConfig,
    load_deployment,
)
from tetris.device import (
    GIB,
    KVMemoryError,
    bundle_gpus,
    check_device_bundles,
    check_kv_blocks,
    dtype_for_device,
    kv_blocks_that_fit,
    resolve_device,
    with_device_defaults,
)

HAS_CUDA = torch.cuda.is_available()


# -- the device (rule 1) ----------------------------------------------------------------------
@pytest.mark.parametrize("requested, cuda, gpu_ids, want", [
    ("auto", True, [0], "cuda"),      # Ray gave the actor a GPU
    ("auto", True, [], "cpu"),        # Ray gave it none (CUDA_VISIBLE_DEVICES would hide them)
    ("auto", True, None, "cpu"),      # outside Ray (in-process tests): only if asked for
    ("auto", False, None, "cpu"),
    ("auto", False, [], "cpu"),
    ("cpu", True, [0], "cpu"),
    ("cuda", True, [3], "cuda"),
])
def test_resolve_device(requested, cuda, gpu_ids, want):
    assert resolve_device(requested, cuda, gpu_ids) == want


@pytest.mark.parametrize("gpu_ids", [None, [], [0]])
def test_cuda_without_cuda_is_a_config_error_naming_cuda(gpu_ids):
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda", False, gpu_ids)


def test_dtype_auto_is_bf16_on_cuda_and_float32_on_cpu():
    assert dtype_for_device("auto", "cuda") == "bfloat16"
    assert dtype_for_device("auto", "cpu") == "float32"
    assert dtype_for_device("float16", "cuda") == "float16"
    assert dtype_for_device("float32", "cuda") == "float32"
    assert ModelConfig().dtype == "auto" and ModelConfig().device == "auto"


@pytest.mark.skipif(HAS_CUDA, reason="the start-up failure needs a machine without CUDA")
def test_a_decode_rank_asked_for_cuda_fails_at_start_on_this_machine():
    from tetris.actors.decode.rank import DecodeRank

    deployment = DeploymentConfig(model=ModelConfig(device="cuda"),
                                  decode=DecodeConfig(tp_size=1, kv_blocks=64))
    rank = DecodeRank(0, 0, 1, deployment)
    with pytest.raises(ConfigError, match="model.device = 'cuda' but CUDA is not available"):
        rank.init_group("127.0.0.1", 0, 5.0)
    assert rank.engine is None


def test_a_decode_rank_on_auto_outside_ray_runs_on_cpu_with_the_configured_blocks():
    from tetris.actors.decode.rank import DecodeRank

    deployment = DeploymentConfig(model=ModelConfig(num_layers=2),
                                  decode=DecodeConfig(tp_size=1, kv_blocks=48, block_size=8))
    rank = DecodeRank(0, 0, 1, deployment)
    rank.init_group("127.0.0.1", 0, 5.0)
    cache = rank.engine.cache
    assert (cache.buffer.device.type, cache.buffer.dtype, cache.num_blocks) == (
        "cpu", torch.float32, 48)


# -- GPUs per bundle (rule 3) -----------------------------------------------------------------
def test_bundle_gpus():
    assert bundle_gpus("auto", 0.0, 1, "decode", "gpus_per_rank") == 0.0
    assert bundle_gpus("auto", 0.25, 1, "decode", "gpus_per_rank") == 0.25
    assert bundle_gpus("cuda", 0.0, 4, "prefill", "gpus_per_instance") == 4.0
    assert bundle_gpus("cuda", 0.5, 4, "prefill", "gpus_per_instance") == 0.5
    assert bundle_gpus("cpu", 0.0, 2, "prefill", "gpus_per_instance") == 0.0
    with pytest.raises(ConfigError, match="decode.gpus_per_rank = 1 GPUs"):
        bundle_gpus("cpu", 1.0, 1, "decode", "gpus_per_rank")


def test_placement_bundles_follow_the_device():
    from tetris.actors.placement import decode_bundles, prefill_bundles

    cuda = with_device_defaults(DeploymentConfig(model=ModelConfig(device="cuda")))
    assert prefill_bundles(cuda.prefill, 2) == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert decode_bundles(cuda.decode) == [{"CPU": 1.0, "GPU": 1.0}] * 2   # TP 2
    cpu = with_device_defaults(DeploymentConfig(model=ModelConfig()))
    assert prefill_bundles(cpu.prefill, 4) == [{"CPU": 1.0}] * 4
    assert decode_bundles(cpu.decode) == [{"CPU": 1.0}] * 2
    shared = with_device_defaults(DeploymentConfig(
        model=ModelConfig(device="cuda"), decode=DecodeConfig(tp_size=4, gpus_per_rank=0.25,
                                                              cpus_per_rank=0.0)))
    assert decode_bundles(shared.decode) == [{"GPU": 0.25}] * 4   # four ranks on one GPU


def test_placement_none_mode_still_asks_ray_for_the_gpus():
    from tetris.actors.placement import Placement

    assert Placement("none", gpus=0.5).options(0)["num_gpus"] == 0.5
    assert "num_gpus" not in Placement("none").options(0)


def test_bundles_asking_for_gpus_the_cluster_lacks_fail_naming_cuda():
    bundles = [{"CPU": 1.0, "GPU": 1.0}] * 2
    with pytest.raises(ConfigError, match=r"asks for 2 GPUs \(CUDA\) but the Ray cluster has 0"):
        check_device_bundles(bundles, 0.0, "decode instance 0 (TP 2)")
    check_device_bundles(bundles, 2.0, "decode instance 0 (TP 2)")
    check_device_bundles([{"CPU": 1.0}], 0.0, "cpu pool")


def test_a_cuda_deployment_file_gets_gpus_and_a_cpu_one_with_gpus_is_refused(tmp_path):
    p = tmp_path / "gpu.toml"
    p.write_text("[model]\ndevice = 'cuda'\n[prefill]\ntp_size = 2\n[decode]\ntp_size = 4\n")
    cfg = load_deployment(p)
    assert (cfg.prefill.gpus_per_instance, cfg.decode.gpus_per_rank) == (2.0, 1.0)
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\ndevice = 'cpu'\n[decode]\ngpus_per_rank = 1\n")
    with pytest.raises(ConfigError, match=f"{bad}: model.device = 'cpu' but decode.gpus_per_rank"):
        load_deployment(bad)
    for body, key in [("[decode]\ngpu_memory_utilization = 1.5\n", "gpu_memory_utilization"),
                      ("[prefill]\nactivation_reserve_gib = -1\n", "activation_reserve_gib"),
                      ("[model]\ndevice = 'tpu'\n", "model.device")]:
        p.write_text(("[model]\n" if "[model]" not in body else "") + body)
        with pytest.raises(ConfigError, match=key):
            load_deployment(p)


# -- KV sizing (rule 4) -----------------------------------------------------------------------
def test_kv_blocks_that_fit_is_utilization_times_total_minus_weights_and_reserve():
    # 80 GiB at 0.9 = 72 GiB; 16 GiB weights and 2 GiB reserve leave 54 GiB = 27,648 blocks of 2 MiB
    args = {"total_bytes": 80 * GIB, "utilization": 0.9, "weight_bytes": 16 * GIB,
            "reserve_bytes": 2 * GIB, "block_bytes": 2 << 20}
    assert kv_blocks_that_fit(**args) == 27648
    assert kv_blocks_that_fit(**(args | {"utilization": 0.5})) == 11264   # 40 - 18 GiB
    assert kv_blocks_that_fit(**(args | {"share": 0.5})) == 9216          # 36 - 18 GiB
    assert check_kv_blocks(0, **args) == 27648
    assert check_kv_blocks(20000, **args) == 20000


def test_a_model_that_does_not_fit_fails_with_the_numbers():
    # LLaMA3-70B in bf16 (~131 GiB) on one 80 GiB GPU
    with pytest.raises(KVMemoryError) as e:
        check_kv_blocks(0, total_bytes=80 * GIB, utilization=0.9, weight_bytes=131.4 * GIB,
                        reserve_bytes=2 * GIB, block_bytes=5 << 20)
    msg = str(e.value)
    assert "does not fit" in msg and "0.9 x 80.00 GiB" in msg and "131.40 GiB weights" in msg
    assert "2.00 GiB activation reserve" in msg
    with pytest.raises(KVMemoryError, match=r"decode.kv_blocks = 30000 blocks of 2.00 MiB "
                                            r"\(58.59 GiB\) do not fit.*holds 27648"):
        check_kv_blocks(30000, total_bytes=80 * GIB, utilization=0.9, weight_bytes=16 * GIB,
                        reserve_bytes=2 * GIB, block_bytes=2 << 20)


def test_on_cpu_the_configured_block_count_is_used_and_zero_is_refused():
    from tetris.actors.device import kv_blocks_on_device

    kw = {"device": "cpu", "model": None, "block_size": 16, "utilization": 0.9,
          "reserve_gib": 1.0, "gpus": 0.0, "what": "prefill.kv_blocks_per_instance"}
    assert kv_blocks_on_device(4096, **kw) == 4096
    with pytest.raises(ConfigError, match="needs CUDA"):
        kv_blocks_on_device(0, **kw)


def test_actor_kv_blocks_on_cuda_from_a_fake_gpu(monkeypatch):
    """The CUDA branch on this machine: the GPU's total is faked, the model and its weights real."""
    from tetris.actors.decode.emulated import decode_model_spec
    from tetris.actors.device import decode_kv_blocks, prefill_kv_blocks, weight_bytes

    from tetris.config import PrefillConfig
    from tetris.model.llama import LlamaModel

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 1 << 30))
    model = LlamaModel(ModelConfig(num_layers=2))
    block = 2 * 2 * 16 * 2 * 32 * 4   # K and V, 2 layers, 16 tokens, 2 KV heads, D 32, fp32
    weights = weight_bytes(model)
    # the Llama geometry's parameters (decode_model_spec) in fp32, and the RoPE frequencies
    assert weights == decode_model_spec(ModelConfig(num_layers=2)).weight_bytes + 16 * 4

    def prefill(**kw):
        pc = PrefillConfig(kv_blocks_per_instance=0, gpu_memory_utilization=0.5,
                           activation_reserve_gib=0.0, **kw)
        return prefill_kv_blocks(pc, model, "cuda")

    half = int((0.5 * 0.5 * (1 << 30) - weights) // block)
    assert prefill(gpus_per_instance=0.5) == half
    assert prefill(gpus_per_instance=1.0, tp_size=2) == half   # each TP rank holds half a GPU
    assert prefill(gpus_per_instance=2.0, tp_size=2) == int((0.5 * (1 << 30) - weights) // block)
    dc = DecodeConfig(kv_blocks=10**6, gpus_per_rank=1.0, activation_reserve_gib=0.5)
    with pytest.raises(KVMemoryError, match=r"decode.kv_blocks = 1000000 blocks .* 0.50 GiB "
                                            r"activation reserve holds \d+;"):
        decode_kv_blocks(dc, model, "cuda")
