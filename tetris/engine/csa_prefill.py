"""CSA as an attention op for a whole-sequence prefill: the hook a prefill path can call.

LOSSY (kernels/csa.py): with ``[csa] enabled`` far tokens are dropped from attention. This is
an EMULATION of a sequence-sharded prefill in one process: every shard's attention runs here,
and the KV that the shards would exchange is counted, not sent. Nothing in the live prefill
pool calls it yet; ``CsaPrefill(...)`` has the ``attention(i, q, k, v)`` signature of
``Llama.forward``, so a path that runs a whole sequence can pass it instead of dense attention.

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

__all__ = ["CsaPrefill", "CsaStats"]

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
                    "shards, %d per node", self.drop_ratios, layout.shards,
                    layout.shards_per_node)

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
        for a in range(lay.shards):
            lo, hi = lay.bounds[a], lay.bounds[a + 1]
            for b in range(a, lay.shards):
                level = 1 if a == b else (
                    2 if a // lay.shards_per_node == b // lay.shards_per_node else 3)
                dense = (hi - lo) * hkv
                kept = int(keep[level - 1][lo:hi].sum()) if keep else dense
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
