"""SP-TP (actors/prefill/sptp.py) against the single instance, without Ray: one layer's
attention block over gloo with ranks as threads (history, KV heads replicated on a group of 4
over 2 KV heads, Appendix A's volume), and forced plans mixing ring, a2a and sptp chunks on the
in-process pool (real ModelExecutors on threads of one process)."""

from __future__ import annotations

import pytest
import torch
from cdsp_check import check_plan, prompt
from gloo_threads import run_ranks
from stored_kv import assert_stored_kv_within_fp32
from tetris.actors.prefill.balance import plan_balance
from tetris.actors.prefill.head_shards import head_shard_slices, head_split_problem
from tetris.actors.prefill.kv_store import ranges_tensor
from tetris.actors.prefill.layout import forced_plan
from tetris.actors.prefill.sptp import SpTpAttention
from tetris.actors.prefill.threaded import ThreadedPool
from tetris.actors.prefill.zigzag import zigzag_layout
from tetris.kernels.attention import attention_with_lse_ref


def test_head_shards_replicate_kv_heads_on_large_groups():
    assert head_shard_slices(1, 2, 8, 2) == (slice(4, 8), slice(1, 2))
    # 4 members over 2 KV heads: members 0, 1 share KV head 0; 2, 3 share KV head 1
    assert [head_shard_slices(j, 4, 8, 2)[1] for j in range(4)] == [
        slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    assert head_shard_slices(5, 16, 32, 8) == (slice(10, 12), slice(2, 3))
    assert "does not divide 8 heads" in head_split_problem(3, 8, 2)
    assert head_split_problem(8, 24, 4) == ""    # 3 query heads each, pairs share a KV head
    # 6 members of 4 query heads over KV heads of 6: member 1 would read two KV heads unevenly
    assert "neither divides 4 KV heads" in head_split_problem(6, 24, 4)


@pytest.mark.parametrize("s,hist", [(2, 0), (2, 23), (4, 31)])
@torch.inference_mode()
def test_attention_block_over_gloo_matches_the_whole_sequence(model, s, hist):
    """Layer 1's attention block (q, k, v from the gathered rows, o_proj partials reduced)
    against the model's own block over the whole sequence; history balanced from one member."""
    end, i, d = hist + 41, 1, model.embed_tokens.weight.shape[1]
    x = torch.randn(end, d, generator=torch.Generator().manual_seed(s + hist))
    pos = torch.arange(end)
    q, k, v = model.layer_qkv(i, x, pos)
    ref = model.layer_attn_out(i, x, attention_with_lse_ref(q, k, v, causal=True)[0])
    _, after = plan_balance(list(zigzag_layout(0, hist, 1)), tuple(range(s)))
    chunk = zigzag_layout(hist, end, s)
    q_pos = [ranges_tensor(c) for c in chunk]
    blocks = [ranges_tensor(tuple(sorted(after[r] + chunk[r]))) for r in range(s)]

    def member(r, world):
        sp = SpTpAttention(tuple(range(s)), r, q_pos, blocks, hist, tag=3, timeout_s=20.0,
                           link=world)
        out = sp.attention_block(model, i, x[q_pos[r]], k[blocks[r]], v[blocks[r]])
        return out, sp.sent_elements

    outs = run_ranks(s, member)
    for r in range(s):
        torch.testing.assert_close(outs[r][0], ref[q_pos[r]], rtol=1e-5, atol=1e-5)
    sent = sum(n for _, n in outs)
    l, dh = end - hist, model.head_dim
    kv_to_others = sum(blocks[r][blocks[r] < hist].numel() * 2 * dh * sum(
        head_shard_slices(j, s, 8, 2)[1].stop - head_shard_slices(j, s, 8, 2)[1].start
        for j in range(s) if j != r) for r in range(s))
    # Appendix A: all-gather l·d·(s−1) + reduce-scatter l·d·(s−1); plus the history's KV
    assert sent == 2 * l * d * (s - 1) + kv_to_others


@pytest.fixture(scope="module")
def local_pool(model):
    return ThreadedPool(model, 4, num_blocks=96, block_size=16, timeout_s=20.0)


@pytest.mark.parametrize("n,spec,layouts", [
    (700, "700x2:sptp", ["sptp"]),                                          # no history
    (1000, "300x1,400x2:sptp,restx4:sptp", ["ring", "sptp", "sptp"]),       # KV heads replicated
    (1100, "300x2:a2a,400x2:sptp,restx4", ["a2a", "sptp", "ring"]),          # three layouts
    (900, "300x2:sptp,restx2:a2a/3", ["sptp", "a2a"]),                      # a2a over sptp's KV
])
def test_sptp_and_mixed_plans_match_single_instance(local_pool, model, n, spec, layouts):
    plan = forced_plan(f"sptp-{spec}", n, spec, (0, 0, 1, 1), num_kv_heads=2, num_heads=8)
    assert [c.sp_layout for c in plan.chunks] == layouts
    ids = prompt(n, n)
    check_plan(local_pool, model, plan, ids)
    assert_stored_kv_within_fp32(local_pool, model, plan, ids)
    local_pool.release(plan.request_id)


def test_a_group_that_cannot_split_the_heads_runs_the_ring():
    plan = forced_plan("sptp-3", 600, "300x1,restx3:sptp", (0, 0, 1, 1), num_kv_heads=2,
                       num_heads=8)
    assert [c.sp_layout for c in plan.chunks] == ["ring", "ring"]
    assert "sptp asked, ring run: a group of 3 does not divide 8 heads" in \
        plan.chunks[1].sp_layout_reason
