"""The tiny served cluster the end-to-end tests deploy: 4 prefill instances on 2 nodes, one
decode instance of TP 2, NIXL transfers, and a latency profile scaled to this CPU so that the
planner uses SP 1, 2 and 4."""

from __future__ import annotations

from tetris.scheduler.latency import load_profile

MODEL = "tetris-tiny-llama"


def write_tiny_cluster(tmp, extra: str = "") -> str:
    """Write the deployment (and its profile) under ``tmp``, with the TOML tables ``extra``
    appended; returns the deployment's path."""
    profile = load_profile("a100-llama3-8b-tp1").scaled(name="cpu-test", linear=100.0,
                                                        attention=1000.0, overhead=10.0)
    profile.save(tmp / "cpu-test.json")
    path = tmp / "deployment.toml"
    path.write_text(f"""
[model]
name = "{MODEL}"
source = "dummy"
seed = 0
vocab_size = 512
hidden_size = 256
intermediate_size = 688
num_layers = 4
num_heads = 8
num_kv_heads = 2
max_position_embeddings = 4096

[prefill]
num_instances = 4
node_size = 2
kv_blocks_per_instance = 256

[decode]
num_instances = 1
tp_size = 2
kv_blocks = 512
max_batch_size = 32

[scheduler]
policy = "tetris"
sp_candidates = [1, 2, 4]
profile = "{tmp / 'cpu-test.json'}"
improvement_rate = 0.0
min_chunk_tokens = 64

[transfer]
backend = "nixl"
timeout_s = 30.0
""" + extra)
    return str(path)
