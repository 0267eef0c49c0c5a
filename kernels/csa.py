"""CSA: communication-efficient sparse attention over a sequence-sharded prefill (CSPS §3.2.4).

LOSSY unless every drop ratio is 0. One sequence is cut into ``N`` shards (SPTs) placed in
sequence order on instances, ``shards_per_node`` to a node (proximity-aware placement, notes
§1.5). A query in shard ``s`` sees three disjoint key sets, one per level (notes §1.7.6,
semantics (b), so that zero drop is exactly dense causal attention):

    level 1   its own shard, causal                                  never drops
    level 2   earlier shards on the same node (no mask: all in the past)  drops p2
    level 3   earlier shards on other nodes                          drops p3

Which tokens a shard drops at a level is decided on the sender side from the previous layer's
level-1 attention (notes §1.7.4, FastGen): a token's importance for KV head ``g`` is the
attention probability its own shard's queries of ``g``'s query heads gave it. The
``floor(p·n)`` least important tokens of an ``n``-token shard are dropped (Q, K and V), ties
broken by position (the later token drops first), so keep sets nest across levels. A query
dropped at a level gets no output there (lse −inf); level 1 keeps every query, so every row
has a result. The levels merge by their softmax denominators, Eq. 5 in log-sum-exp form:

    O = Σ_v exp(lse_v − LSE) · O_v,   LSE = log Σ_v exp(lse_v)

Shapes: q [T, Hq, D], k, v [T, Hkv, D], keep masks [T, Hkv] bool, out [T, Hq, D],
lse [Hq, T] float32, importance [T, Hkv] float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .merge import merge_attention_all

__all__ = [
    "CsaLayout",
    "csa_attention",
    "keep_masks",
    "level_drop_ratios",
    "masked_attention_with_lse",
]

LEVELS = 3


def level_drop_ratios(p2: float, p3: float | None = None) -> tuple[float, float, float]:
    """(p1, p2, p3). p1 = 0 (Appendix B); p3 defaults to the corrected §1.7.3 rule
    1 − p3 = (1 − p2)/2 (the paper prints it inverted)."""
    if p3 is None:
        p3 = 1.0 - (1.0 - p2) / 2.0
    return (0.0, p2, p3)


@dataclass(frozen=True)
class CsaLayout:
    """Shard boundaries of one sequence: shard s holds positions [bounds[s], bounds[s+1])."""

    bounds: tuple[int, ...]
    shards_per_node: int

    @classmethod
    def even(cls, tokens: int, shards: int, shards_per_node: int) -> CsaLayout:
        """Shards as equal as possible, earlier shards one token longer."""
        base, extra = divmod(tokens, shards)
        bounds = [0]
        for s in range(shards):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
        return cls(tuple(bounds), shards_per_node)

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    def shard_of(self) -> torch.Tensor:
        """[T] shard index of every position."""
        sizes = torch.tensor([self.bounds[s + 1] - self.bounds[s] for s in range(self.shards)])
        return torch.repeat_interleave(torch.arange(self.shards), sizes)

    def level_of_pair(self) -> torch.Tensor:
        """[T, T] int8: the level at which query i sees key j (0: never, j after i)."""
        shard = self.shard_of()
        node = shard // self.shards_per_node
        t = shard.numel()
        pos = torch.arange(t)
        same_shard = shard[:, None] == shard[None, :]
        earlier_shard = shard[None, :] < shard[:, None]
        same_node = node[:, None] == node[None, :]
        level = torch.zeros(t, t, dtype=torch.int8)
        level[same_shard & (pos[None, :] <= pos[:, None])] = 1
        level[earlier_shard & same_node] = 2
        level[earlier_shard & ~same_node] = 3
        return level


def keep_masks(importance: torch.Tensor | None, layout: CsaLayout,
               drop_ratios: tuple[float, float, float]) -> list[torch.Tensor]:
    """One [T, Hkv] bool keep mask per level. ``importance`` None (layer 0) keeps everything.

    Per shard and KV head, tokens are ranked once (importance descending, then position
    ascending), and level v keeps the first ``n − floor(p_v·n)``: nested keep sets."""
    if importance is None:
        return []
    t, hkv = importance.shape
    masks = []
    for p in drop_ratios:
        keep = torch.zeros(t, hkv, dtype=torch.bool)
        for s in range(layout.shards):
            lo, hi = layout.bounds[s], layout.bounds[s + 1]
            n = hi - lo
            kept = n - math.floor(p * n)
            if kept == n:
                keep[lo:hi] = True
                continue
            # Stable sort of −importance: equal scores keep their position order.
            order = torch.sort(-importance[lo:hi].float(), dim=0, stable=True).indices
            rows = order[:kept]  # [kept, Hkv]
            keep[lo:hi].scatter_(0, rows, True)
        masks.append(keep)
    return masks


def masked_attention_with_lse(q, k, v, visible, scale: float | None = None):
    """Softmax attention where query i of head h sees key j iff visible[h, i, j].

    q [Tq, Hq, D], k, v [Tk, Hkv, D], visible [Hq, Tq, Tk] bool. Returns out [Tq, Hq, D]
    (0 for a row that sees nothing), lse [Hq, Tq] float32 (−inf there), probs [Hq, Tq, Tk]."""
    d = q.shape[-1]
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = ((qf @ kf.transpose(1, 2)) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Tq]
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - shift.unsqueeze(-1))  # rows seeing nothing are all 0
    out = probs @ vf  # [Hq, Tq, D]
    return out.transpose(0, 1).to(q.dtype), lse, probs


def _level_visible(level_of_pair, v: int, keep: torch.Tensor | None, group: int,
                   drop_queries: bool):
    """[Hq, T, T] bool: pairs at level v whose key (and query, if queries drop too) survives
    level v's drop."""
    region = (level_of_pair == v).unsqueeze(0)  # [1, T, T]
    if keep is None:
        return region
    kq = keep.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, T]
    visible = region & kq.unsqueeze(1)
    return visible & kq.unsqueeze(-1) if drop_queries else visible


def csa_attention(q, k, v, layout: CsaLayout, keep: list[torch.Tensor], *,
                  drop_queries: bool = True):
    """CSA for one layer of one sharded sequence (positions 0..T−1, no history).

    ``keep`` is ``keep_masks(...)`` (empty: drop nothing). ``drop_queries`` False keeps every
    query at every level and drops only keys and values (not the paper's rule, which drops Q
    too; a variant to see where the loss comes from). Returns (out [T, Hq, D],
    lse [Hq, T], importance [T, Hkv] for the next layer's ``keep_masks``, parts) where
    parts is the per-level [(out_v, lse_v)] merged by Eq. 5."""
    t, hq, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    level_of_pair = layout.level_of_pair()
    parts = []
    importance = None
    for v_idx in range(LEVELS):
        visible = _level_visible(level_of_pair, v_idx + 1, keep[v_idx] if keep else None, group,
                                 drop_queries)
        out_v, lse_v, probs = masked_attention_with_lse(q, k, v, visible)
        parts.append((out_v, lse_v))
        if v_idx == 0:
            # Level-1 probabilities normalised within the shard: local to the sender.
            col = probs.sum(dim=1)  # [Hq, T]: attention each key received
            importance = col.reshape(hkv, group, t).sum(dim=1).transpose(0, 1)  # [T, Hkv]
    out, lse = merge_attention_all(parts)  # Eq. 5
    return out, lse, importance, parts
