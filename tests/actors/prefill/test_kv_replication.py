"""SP-NTP on groups larger than the KV heads (each KV head replicated on s/Hkv members,
actors/prefill/head_shards.py): one-process and gloo all-to-all, pipelined or not, against
full causal attention, and pool plans against the single instance (tiny model, 2 KV heads,
groups of 4)."""

from __future__ import annotations

import pytest
import torch
from cdsp_check import check_plan, prompt
from gloo_threads import run_ranks
from tetris.actors.prefill.alltoall import AllToAllAttention, simulate_all_to_all
from tetris.actors.prefill.alltoall_pipeline import PipelinedAllToAll
from tetris.actors.prefill.balance import plan_balance
from tetris.actors.prefill.kv_store import ranges_tensor
from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.threaded import ThreadedPool
from tetris.actors.prefill.zigzag import zigzag_layout
from tetris.kernels.attention import attention_with_lse_ref


def _case(seed, hist, end, s, s_old, hq, hkv, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(end, h, d, generator=g) for h in (hq, hkv, hkv))
    _, after = plan_balance(list(zigzag_layout(0, hist, s_old)), tuple(range(s)))
    chunk = zigzag_layout(hist, end, s)
    q_pos = [ranges_tensor(c) for c in chunk]
    blocks = [ranges_tensor(tuple(sorted(after[r] + chunk[r]))) for r in range(s)]
    ref, _ = attention_with_lse_ref(q, k, v, causal=True)
    return q, k, v, q_pos, blocks, ref


@pytest.mark.parametrize("s,s_old,hq,hkv,hist", [
    (4, 1, 8, 2, 0), (4, 2, 8, 2, 37), (8, 4, 8, 4, 50), (8, 2, 16, 2, 19), (16, 8, 32, 8, 70)])
def test_replicated_all_to_all_matches_causal_attention(s, s_old, hq, hkv, hist):
    q, k, v, q_pos, blocks, ref = _case(s + hist, hist, hist + 45, s, s_old, hq, hkv)
    outs = simulate_all_to_all([q[p] for p in q_pos], q_pos, [k[b] for b in blocks],
                               [v[b] for b in blocks], blocks)
    for r, p in enumerate(q_pos):
        torch.testing.assert_close(outs[r], ref[p], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("micro", [1, 3])
def test_replicated_all_to_all_over_gloo(micro):
    """4 members over 2 KV heads on one world (threads): each member gets its queries' heads
    and the one KV head they read from every member, so each KV head travels to 2 members."""
    s, hist, end, d = 4, 29, 29 + 43, 8
    q, k, v, q_pos, blocks, ref = _case(9, hist, end, s, 1, 8, 2)

    def member(r, world):
        args = (tuple(range(s)), r, q_pos, blocks, 6, 20.0, world)
        a2a = (PipelinedAllToAll(*args, micro_partitions=micro) if micro > 1
               else AllToAllAttention(*args))
        return a2a(q[q_pos[r]], q_pos[r], k[blocks[r]], v[blocks[r]]), a2a.sent_elements

    outs = run_ranks(s, member)
    for r, p in enumerate(q_pos):
        torch.testing.assert_close(outs[r][0], ref[p], rtol=1e-5, atol=1e-5)
    # A2A #1: queries (2 heads) and the block's one KV head to each of 3 peers; A2A #2: outputs
    expect = sum(3 * (q_pos[r].numel() * 2 * d + blocks[r].numel() * 2 * 1 * d)
                 + sum(q_pos[j].numel() for j in range(s) if j != r) * 2 * d for r in range(s))
    assert sum(n for _, n in outs) == expect


@pytest.fixture(scope="module")
def local_pool(model):
    return ThreadedPool(model, 4, num_blocks=96, block_size=16, timeout_s=20.0)


@pytest.mark.parametrize("n,spec", [
    (800, "300x1:a2a,restx4:a2a"),                  # group of 4 over 2 KV heads
    (1000, "300x2:a2a,400x4:a2a/3,restx4:sptp"),    # pipelined, then SP-TP, both replicated
])
def test_replicated_plans_match_single_instance(local_pool, model, n, spec):
    plan = forced_plan(f"rep-{spec}", n, spec, (0, 0, 1, 1), num_kv_heads=2, num_heads=8)
    assert all(c.sp_layout != "ring" for c in plan.chunks)
    assert len(plan.chunks[-1].instances) == 4
    check_plan(local_pool, model, plan, prompt(n, n + 1))
    local_pool.release(plan.request_id)
