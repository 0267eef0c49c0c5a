"""CSA in the ring (actors/prefill/csa_ring.py) over gloo with ranks as threads: per layer it
equals the single-process CSA of kernels/csa.py on the members' blocks as shards (history
included), with zero drop it is dense causal attention, and the KV elements each hop carries
shrink to the most any member still ahead of the block keeps."""

from __future__ import annotations

import pytest
import torch
from gloo_threads import run_ranks
from tetris.actors.prefill.balance import plan_balance
from tetris.actors.prefill.csa_ring import CsaRingAttention
from tetris.actors.prefill.kv_store import ranges_tensor
from tetris.actors.prefill.ring import RingAttention
from tetris.actors.prefill.zigzag import zigzag_layout
from tetris.kernels.attention import attention_with_lse_ref
from tetris.kernels.csa import CsaLayout, csa_attention, keep_masks, kept_count

HQ, HKV, D = 4, 2, 8


def _blocks(s: int, hist: int, end: int):
    """Queries' and blocks' positions of a chunk [hist, end) zigzagged over s members, the
    history [0, hist) spread over them by cache balancing (as the pool places it)."""
    _, after = plan_balance(list(zigzag_layout(0, hist, 2)), tuple(range(s)))
    chunk = zigzag_layout(hist, end, s)
    q_pos = [ranges_tensor(c) for c in chunk]
    blocks = [ranges_tensor(tuple(sorted(after[r] + chunk[r]))) for r in range(s)]
    return q_pos, blocks


def _run_csa(nodes, ratios, hist, end, layers, *, drop_queries=True, seed=0):
    """Every member runs ``layers`` layers of the CSA ring on the same q, k, v; per member the
    outputs of each layer, the ring object's counters and the blocks."""
    s = len(nodes)
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(end, HQ, D, generator=g)   # sharp attention: a dropped key matters
    k, v = torch.randn(end, HKV, D, generator=g), torch.randn(end, HKV, D, generator=g)
    q_pos, blocks = _blocks(s, hist, end)

    def member(r, world):
        ring = CsaRingAttention(tuple(range(s)), r, blocks, tag=3, timeout_s=20.0, link=world,
                                member_nodes=nodes, drop_ratios=ratios, num_layers=layers,
                                drop_queries=drop_queries)
        outs = [ring(q[q_pos[r]], q_pos[r], k[blocks[r]], v[blocks[r]], layer=i)
                for i in range(layers)]
        return outs, ring

    return run_ranks(s, member), (q, k, v), q_pos, blocks


def _reference_layers(qkv, q_pos, blocks, nodes, ratios, hist, layers, drop_queries=True):
    """kernels/csa.py on the members' blocks as shards: each layer's output at every chunk
    position, layer 0 and the last dense, the middle ones by the previous layer's scores."""
    q, k, v = qkv
    end = k.shape[0]
    owner = torch.empty(end, dtype=torch.long)
    for r, b in enumerate(blocks):
        owner[b] = r
    layout = CsaLayout.of_owners(owner.tolist(), nodes)
    outs, importance = [], None
    for i in range(layers):
        keep = keep_masks(importance if i < layers - 1 else None, layout, ratios)
        out, _, importance, _ = csa_attention(q[hist:], k, v, layout, keep,
                                              drop_queries=drop_queries, q_start=hist)
        outs.append(out)
    return outs


@pytest.mark.parametrize("nodes,ratios,hist,drop_queries", [
    ((0, 0, 1, 1), (0.0, 0.25, 0.625), 0, True),
    ((0, 1, 1, 0), (0.0, 0.2, 0.6), 27, True),
    ((0, 0, 1, 1), (0.0, 0.0, 0.5), 13, False),
    ((0, 1, 2), (0.0, 0.4, 0.3), 9, True),   # p3 < p2: a hop carries the larger keep set
])
@torch.inference_mode()
def test_csa_ring_equals_single_process_csa_per_layer(nodes, ratios, hist, drop_queries):
    end, layers = hist + 45, 4
    results, qkv, q_pos, blocks = _run_csa(nodes, ratios, hist, end, layers,
                                           drop_queries=drop_queries)
    ref = _reference_layers(qkv, q_pos, blocks, nodes, ratios, hist, layers, drop_queries)
    dense = attention_with_lse_ref(*qkv, causal=True)[0][hist:]
    for i in range(layers):
        for r, (outs, _) in enumerate(results):
            torch.testing.assert_close(outs[i], ref[i][q_pos[r] - hist], rtol=1e-5, atol=1e-5)
    assert (ref[1] - dense).abs().max() > 1e-2   # the middle layers did drop
    torch.testing.assert_close(ref[3], dense, rtol=1e-5, atol=1e-5)   # the last is dense


@torch.inference_mode()
def test_zero_drop_is_dense_and_moves_what_the_dense_ring_moves():
    nodes, hist, end = (0, 0, 1, 1), 21, 21 + 38
    results, qkv, q_pos, blocks = _run_csa(nodes, (0.0, 0.0, 0.0), hist, end, 3)
    dense = attention_with_lse_ref(*qkv, causal=True)[0]
    for r, (outs, ring) in enumerate(results):
        for i in range(3):
            torch.testing.assert_close(outs[i], dense[q_pos[r]], rtol=1e-5, atol=1e-5)
    # the dense ring on the same blocks: every block goes s − 1 hops whole
    q, k, v = qkv

    def member(r, world):
        ring = RingAttention(tuple(range(4)), r, blocks, tag=5, timeout_s=20.0, link=world)
        for i in range(3):
            ring(q[q_pos[r]], q_pos[r], k[blocks[r]], v[blocks[r]], layer=i)
        return ring.sent_elements

    dense_sent = run_ranks(4, member)
    assert sum(dense_sent) == 3 * 3 * sum(b.numel() for b in blocks) * 2 * HKV * D
    assert [ring.sent_elements for _, ring in results] == dense_sent


@torch.inference_mode()
def test_hops_carry_the_kept_rows_and_cross_nodes_with_the_level3_share():
    # Ring 0 → 1 → 2 → 3 → 0 over nodes (0, 0, 1, 1). Block 0's trip: member 1 (level 2),
    # 2 and 3 (level 3): the hop to 1 carries level 2's keep set, the hops to 2 and 3 level
    # 3's. Block 1: 2, 3 (level 3), then 0 (level 2): every hop carries level 2's.
    nodes, ratios, end, layers = (0, 0, 1, 1), (0.0, 0.25, 0.625), 48, 4
    results, _, _, blocks = _run_csa(nodes, ratios, 0, end, layers)
    n = [b.numel() for b in blocks]
    assert n == [12, 12, 12, 12]
    k2, k3 = kept_count(12, 0.25), kept_count(12, 0.625)
    assert (k2, k3) == (9, 5)
    row = 2 * HKV * D   # K and V of one token of every KV head
    # hops per block (src: rows on the hop to src+1, src+2, src+3)
    hops = {0: (k2, k3, k3), 1: (k2, k2, k2), 2: (k2, k3, k3), 3: (k2, k2, k2)}
    per_layer = sum(sum(h) for h in hops.values()) * row
    dense_layer = 3 * sum(n) * row
    sent = sum(ring.sent_elements for _, ring in results)
    assert sent == 2 * dense_layer + 2 * per_layer   # layers 0 and 3 dense, 1 and 2 CSA
    assert per_layer / dense_layer == pytest.approx((4 * k2 + 4 * k2 + 2 * k3 + 2 * k3)
                                                    / (12 * 12))
    # the positions travel with the rows: one int32 per row and KV head
    assert sum(ring.sent_index_elements for _, ring in results) == 2 * per_layer // D // 2
    # inter-node hops: 1 → 2 carries block 1 (k2) and block 0 (k3), then block 3 (k2);
    # 3 → 0 carries block 3 (k2), block 2 (k3), then block 1 (k2)
    inter = sum(ring.inter_node_elements for _, ring in results)
    dense_inter = 2 * 2 * 3 * 12 * row
    assert inter == dense_inter + 2 * 2 * (k2 + k3 + k2) * row
