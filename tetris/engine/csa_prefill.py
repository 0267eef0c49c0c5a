"""CSA as an attention op for a whole-sequence prefill: the hook a prefill path can call.

LOSSY (kernels/csa.py): with ``[csa] enabled`` far tokens are dropped from attention. This is
an EMULATION of a sequence-sharded prefill in one process: every shard's attention runs here,
and the KV that the shards would exchange is counted, not sent. ``CsaPrefill(...)`` has the
``attention(i, q, k, v)`` signature of ``Llama.forward``, so a path that runs a whole sequence
can pass it instead of dense attention. ``csa_chunked_prefill`` runs a prompt chunk by chunk
(each chunk's keys: its own tokens and the history before it), one layout per chunk: the
single-engine reference the prefill pool's CSA ring (``actors/prefill/csa_ring.py``) is tested
against, chunk for chunk.

Per layer: layer 0 has no previous scores and the last layer is left dense (notes §1.7.4,
FastGen: only intermediate layers share unimportant tokens); every other layer drops by the
previous layer's level-1 importance. Communication counted: each shard's KV rows that a later
shard needs (the all-gather volume of the causal KV; a ring carries at least these), by level:
level 2 crosses intra-node links, level 3 inter-node ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tetris.config import CsaConfig
from tetris.kernels.csa import CsaLayout, csa_attention, keep_masks, level_drop_ratios

__all__ = ["CsaPrefill", "CsaStats", "csa_chunked_prefill"]

log = logging.getLogger(__name__)


@dataclass
class CsaStats:
    """Counts summed over layers. kv_rows_*[v]: KV rows (token × KV head) shards receive at
    level v+1 (index 0, level 1, is local: never moved); pairs_*: attention (query head, query,
    key) pairs computed."""

    kv_rows_dense: list[int] = field(default_factory=lambda: [0, 0, 0])
    kv_rows_kept: list[int] = field(default_factory=lambda: [0, 0, 0])
    pairs_dense: int = 0
    pairs_kept: int = 0

    def moved_fraction_dropped(self) -> float:
        """Fraction of the KV rows that cross instances (levels 2 and 3) not sent."""
        dense = sum(self.kv_rows_dense[1:])
        return 1.0 - sum(self.kv_rows_kept[1:]) / dense if dense else 0.0

    def level_fraction_dropped(self, level: int) -> float:
        dense = self.kv_rows_dense[level - 1]
        return 1.0 - self.kv_rows_kept[level - 1] / dense if dense else 0.0

    def pairs_fraction_dropped(self) -> float:
        return 1.0 - self.pairs_kept / self.pairs_dense if self.pairs_dense else 0.0


class CsaPrefill:
    """Stateful attention op for one forward pass over one sequence (positions 0..T−1)."""

    def __init__(self, config: CsaConfig, layout: CsaLayout, num_layers: int, *,
                 drop_queries: bool = True) -> None:
        if not config.enabled:
            raise ValueError("CsaPrefill needs [csa] enabled = true (CSA is opt-in)")
        self.layout = layout
        self.drop_queries = drop_queries
        self.num_layers = num_layers
        self.drop_ratios = level_drop_ratios(config.level2_drop_ratio, config.level3_drop_ratio)
        self.stats = CsaStats()
        self._importance: torch.Tensor | None = None
        log.warning("CSA on (LOSSY sparse attention): drop ratios p1, p2, p3 = %s over %d "
                    "shards on nodes %s", self.drop_ratios, layout.shards, layout.shard_nodes)

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        last = i == self.num_layers - 1
        importance = None if last else self._importance
        keep = keep_masks(importance, self.layout, self.drop_ratios)
        out, _, self._importance, _ = csa_attention(q, k, v, self.layout, keep,
                                                drop_queries=self.drop_queries)
        self._count(keep, k.shape[1], q.shape[1] // k.shape[1])
        return out

    def _count(self, keep: list[torch.Tensor], hkv: int, group: int) -> None:
        lay = self.layout
        shard = lay.shard_of()
        last_query = [int(lay.shard_positions(b).max()) if (shard == b).any() else -1
                      for b in range(lay.shards)]
        for a in range(lay.shards):
            idx = lay.shard_positions(a)
            for b in range(lay.shards):
                # the rows of a that b's queries can see: a's own (level 1), else those before
                # b's last query (with contiguous shards: all of an earlier shard's, none later)
                rows = idx if a == b else idx[idx < last_query[b]]
                level = lay.level(a, b)
                dense = rows.numel() * hkv
                kept = int(keep[level - 1][rows].sum()) if keep else dense
                self.stats.kv_rows_dense[level - 1] += dense
                self.stats.kv_rows_kept[level - 1] += kept
        level_of_pair = lay.level_of_pair()
        for v in range(3):
            region = level_of_pair == v + 1
            dense = int(region.sum()) * hkv * group
            self.stats.pairs_dense += dense
            if not keep:
                self.stats.pairs_kept += dense
                continue
            kk = keep[v].float()  # [T, Hkv]
            kq = kk if self.drop_queries else torch.ones_like(kk)
            # Σ_g Σ_{i,j in region} kq[i,g]·kk[j,g], times the group's query heads.
            kept = torch.einsum("ig,ij,jg->", kq, region.float(), kk)
            self.stats.pairs_kept += round(float(kept)) * group


class _ChunkOp:
    """CSA attention of one chunk (queries ``q_start``..) over the KV of every earlier chunk
    (``cache``, per layer) and its own; layer 0 and the last stay dense, as in CsaPrefill."""

    def __init__(self, layout: CsaLayout, q_start: int, drop_ratios, num_layers: int,
                 cache: list, drop_queries: bool) -> None:
        self.layout, self.q_start, self.drop_ratios = layout, q_start, drop_ratios
        self.num_layers, self.cache, self.drop_queries = num_layers, cache, drop_queries
        self._importance: torch.Tensor | None = None

    def __call__(self, i: int, q, k, v):
        if len(self.cache) <= i:
            self.cache.append((k[:0], v[:0]))
        k_all = torch.cat([self.cache[i][0], k])
        v_all = torch.cat([self.cache[i][1], v])
        self.cache[i] = (k_all, v_all)
        importance = None if i == self.num_layers - 1 else self._importance
        keep = keep_masks(importance, self.layout, self.drop_ratios)
        out, _, self._importance, _ = csa_attention(
            q, k_all, v_all, self.layout, keep, drop_queries=self.drop_queries,
            q_start=self.q_start)
        return out


@torch.inference_mode()
def csa_chunked_prefill(model, ids: torch.Tensor, chunks, config: CsaConfig, *,
                        drop_queries: bool = True) -> torch.Tensor:
    """Logits [T, V] of a prompt prefilled chunk by chunk with CSA. ``chunks``: (start, end,
    layout) in order, the layout over positions 0..end−1 (who holds each, this chunk's
    history included). Each chunk ranks its tokens by its own layers' scores (layer 0 of a
    chunk has none yet: dense), as each chunk's ring does. LOSSY; EMULATION in one process."""
    if not config.enabled:
        raise ValueError("csa_chunked_prefill needs [csa] enabled = true (CSA is opt-in)")
    ratios = level_drop_ratios(config.level2_drop_ratio, config.level3_drop_ratio)
    cache: list = []
    logits = []
    for start, end, layout in chunks:
        op = _ChunkOp(layout, start, ratios, model.num_layers, cache, drop_queries)
        hidden = model.forward(ids[start:end], torch.arange(start, end), op)
        logits.append(model.logits(hidden))
    return torch.cat(logits)
