"""Placement on a two-node Ray cluster started on this machine (run by test_placement.py).

Its own process: the test session already holds a Ray connection, and one process can hold
only one. Starts ``ray.cluster_utils.Cluster`` with nodes "a" (head) and "b", 4 CPUs each;
places a prefill pool of 4 tiny workers (SPREAD, 1 CPU each: 2 per node) and a TP-2 decode
instance (STRICT_PACK); runs one plan whose last chunk's ring spans both nodes, checks its
logits against single-process prefill, decodes a few tokens; prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import msgspec
import ray
import torch
from ray.cluster_utils import Cluster

from tetris.actors.decode.instance import DecodeInstance
from tetris.actors.placement import PlacementError, place_decode
from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.pool import PrefillPool
from tetris.config import DecodeConfig, DeploymentConfig, ModelConfig, PrefillConfig
from tetris.kernels.dispatch import attention_with_lse
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

MODEL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, seed=7)
DEPLOYMENT = DeploymentConfig(
    model=MODEL,
    prefill=PrefillConfig(num_instances=4, node_size=2, placement="spread", cpus_per_instance=1.0,
                          block_size=16, kv_blocks_per_instance=16),
    decode=DecodeConfig(tp_size=2, placement="pack", cpus_per_rank=1.0, max_batch_size=2,
                        block_size=4, kv_blocks=32),
)
PROMPT_TOKENS, PLAN_SPEC = 40, "12x2,restx4"


def reference_logits(ids: list[int]) -> torch.Tensor:
    """Last-token logits [V] of single-process causal prefill."""
    model = load_model(MODEL)[0]
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)),
                           lambda i, q, k, v: attention_with_lse(q, k, v, causal=True)[0])
    return model.logits(hidden[-1:])[0]


def run_prefill(label: dict[str, str]) -> dict:
    pool = PrefillPool(DEPLOYMENT, timeout_s=20.0, placement_timeout_s=30.0)
    try:
        ids = torch.randint(0, MODEL.vocab_size, (PROMPT_TOKENS,),
                            generator=torch.Generator().manual_seed(3)).tolist()
        plan = forced_plan("cross-node", PROMPT_TOKENS, PLAN_SPEC, pool.node_of)
        result = pool.run(plan, ids, return_logits=True)
        ref = reference_logits(ids)
        return {
            "prefill_nodes": [label[n] for n in pool.node_ids],
            "prefill_bundle_nodes": [label[n] for n in pool.placement.node_ids],
            "node_map": pool.node_map(),
            "chunk_nodes": [sorted({label[pool.node_ids[i]] for i in c.instances})
                            for c in plan.chunks],
            "first_token": result.first_token,
            "ref_token": int(ref.argmax()),
            "logits_max_diff": float((torch.tensor(result.logits) - ref).abs().max()),
        }
    finally:
        pool.shutdown()


async def run_decode(label: dict[str, str]) -> dict:
    inst = DecodeInstance(DEPLOYMENT, 0, transfer=None, timeout_s=20.0, placement_timeout_s=30.0)
    await inst.start()
    try:
        where = await asyncio.gather(*[r.__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()) for r in inst.ranks])
        sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        await inst.add("d0", list(range(1, 9)), sampling)
        outs = [o async for o in inst.stream("d0")]
        return {"decode_nodes": [label[n] for n in where],
                "decode_bundle_nodes": [label[n] for n in inst.placement.node_ids],
                "decode_tokens": outs[-1].num_tokens}
    finally:
        await inst.shutdown()


def strict_pack_error() -> str:
    """A TP group bigger than any node must fail with a message, not hang."""
    big = msgspec.structs.replace(DEPLOYMENT.decode, cpus_per_rank=3.0)
    try:
        p = place_decode(big, 9, timeout_s=2.0)
    except PlacementError as e:
        return str(e)
    p.remove()
    return ""


def main() -> int:
    t0 = time.perf_counter()
    env = {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 4, "include_dashboard": False})
    node_b = cluster.add_node(num_cpus=4)
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": env})
        label = {cluster.head_node.node_id: "a", node_b.node_id: "b"}
        out = {"nodes": len(ray.nodes()), "startup_s": time.perf_counter() - t0}
        out |= run_prefill(label)
        out |= asyncio.run(run_decode(label))
        out["strict_pack_error"] = strict_pack_error()
        out["elapsed_s"] = time.perf_counter() - t0
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
