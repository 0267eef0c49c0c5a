"""Memory profiles of the KunServe tests: the paper's 14B instance and one that divides evenly."""

from tetris.control.kunserve_memory import InstanceMemory, instance_memory

GIB = 1 << 30


def qwen14b_tp1() -> InstanceMemory:
    """Qwen-2.5-14B (48 layers, GQA 40/8 heads of 128, qkv bias) on one 80 GiB GPU, bf16."""
    return instance_memory(hidden=5120, intermediate=13824, num_layers=48, num_heads=40,
                           num_kv_heads=8, head_dim=128, vocab=152064, dtype_bytes=2,
                           gpu_bytes=80 * GIB, num_gpus=1, block_size=16, qkv_bias=True)


def even6() -> InstanceMemory:
    """6 layers; a layer's weights are 10 layer-blocks, the KV region 100 full blocks, so every
    split into 2 or 3 members divides exactly (P / block_bytes = 10)."""
    lb = 4096
    return InstanceMemory(num_layers=6, layer_param_bytes=10 * lb, other_param_bytes=lb,
                          kv_bytes=100 * 6 * lb, layer_block_bytes=lb, block_size=16)


def served_tiny(landing_blocks: int = 48) -> InstanceMemory:
    """The served pool's view of configs/kunserve-tiny-cpu.toml's instance (4 layers, a layer's
    weights 30 full blocks, 32 blocks of KV): a request takes blocks of its member's part of a
    group only, landing whole in ``landing_blocks`` whole-model blocks."""
    lb = 4096
    return InstanceMemory(num_layers=4, layer_param_bytes=30 * 4 * lb, other_param_bytes=lb,
                          kv_bytes=32 * 4 * lb, layer_block_bytes=lb, block_size=16,
                          member_parts=True, landing_blocks=landing_blocks)
