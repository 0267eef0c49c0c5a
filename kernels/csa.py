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
    "kept_count",
    "key_importance",
    "level_drop_ratios",
    "masked_attention_with_lse",
    "rank_order",
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
    """Which shard holds each position, and each shard's node.

    ``CsaLayout(bounds, shards_per_node)``: contiguous shards in sequence order (the paper's
    placement), shard s holding [bounds[s], bounds[s+1]), ``shards_per_node`` to a node.
    ``CsaLayout.of_owners(owner, shard_nodes)``: any placement, e.g. the ring's zigzag shares
    with history (``actors/prefill/csa_ring.py``): ``owner[p]`` is the shard holding position
    ``p``, ``shard_nodes[s]`` its node. Levels are by ownership and position alone, so both
    placements share one definition (level 2 and 3 keys need ``key position <= query
    position``: with contiguous shards that is every key of an earlier shard)."""

    bounds: tuple[int, ...] = ()
    shards_per_node: int = 1
    owner: tuple[int, ...] = ()
    shard_nodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.bounds and not self.owner:   # contiguous: ownership from the bounds
            owner = [s for s in range(len(self.bounds) - 1)
                     for _ in range(self.bounds[s + 1] - self.bounds[s])]
            object.__setattr__(self, "owner", tuple(owner))
            object.__setattr__(self, "shard_nodes", tuple(
                s // self.shards_per_node for s in range(len(self.bounds) - 1)))

    @classmethod
    def even(cls, tokens: int, shards: int, shards_per_node: int) -> CsaLayout:
        """Shards as equal as possible, earlier shards one token longer."""
        base, extra = divmod(tokens, shards)
        bounds = [0]
        for s in range(shards):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
        return cls(tuple(bounds), shards_per_node)

    @classmethod
    def of_owners(cls, owner, shard_nodes) -> CsaLayout:
        return cls(owner=tuple(int(o) for o in owner), shard_nodes=tuple(shard_nodes))

    @property
    def shards(self) -> int:
        return len(self.shard_nodes)

    def shard_of(self) -> torch.Tensor:
        """[T] shard index of every position."""
        return torch.tensor(self.owner, dtype=torch.long)

    def shard_positions(self, s: int) -> torch.Tensor:
        """Positions held by shard ``s``, ascending."""
        return (self.shard_of() == s).nonzero().flatten()

    def level(self, sender: int, receiver: int) -> int:
        """The level at which shard ``receiver``'s queries see shard ``sender``'s keys."""
        if sender == receiver:
            return 1
        return 2 if self.shard_nodes[sender] == self.shard_nodes[receiver] else 3

    def level_of_pair(self, q_start: int = 0) -> torch.Tensor:
        """[T − q_start, T] int8: the level at which query ``q_start + i`` sees key j (0:
        never, j after the query)."""
        shard = self.shard_of()
        node = torch.tensor(self.shard_nodes, dtype=torch.long)[shard]
        pos = torch.arange(shard.numel())
        qs, qn, qp = shard[q_start:], node[q_start:], pos[q_start:]
        causal = pos[None, :] <= qp[:, None]
        same_shard = qs[:, None] == shard[None, :]
        same_node = qn[:, None] == node[None, :]
        level = torch.zeros(qs.numel(), shard.numel(), dtype=torch.int8)
        level[causal & same_shard] = 1
        level[causal & ~same_shard & same_node] = 2
        level[causal & ~same_node] = 3
        return level


def kept_count(n: int, p: float) -> int:
    """Tokens of an ``n``-token shard kept at drop ratio ``p``: ``n − floor(p·n)``."""
    return n - math.floor(p * n)


def rank_order(importance: torch.Tensor) -> torch.Tensor:
    """[n, Hkv] indices of one shard's tokens per KV head, most important first, ties by
    position (the earlier first): a level keeps a prefix, so keep sets nest across levels."""
    # Stable sort of −importance: equal scores keep their position order.
    return torch.sort(-importance.float(), dim=0, stable=True).indices


def keep_masks(importance: torch.Tensor | None, layout: CsaLayout,
               drop_ratios: tuple[float, float, float]) -> list[torch.Tensor]:
    """One [T, Hkv] bool keep mask per level. ``importance`` None (layer 0) keeps everything.

    Per shard and KV head, tokens are ranked once (``rank_order``), and level v keeps the first
    ``kept_count(n, p_v)``: nested keep sets."""
    if importance is None:
        return []
    t, hkv = importance.shape
    shards = [layout.shard_positions(s) for s in range(layout.shards)]
    orders = [rank_order(importance[idx]) for idx in shards]
    masks = []
    for p in drop_ratios:
        keep = torch.zeros(t, hkv, dtype=torch.bool)
        for idx, order in zip(shards, orders):
            sel = torch.zeros(idx.numel(), hkv, dtype=torch.bool)
            sel.scatter_(0, order[:kept_count(idx.numel(), p)], True)
            keep[idx] = sel
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
                   drop_queries: bool, q_start: int):
    """[Hq, Tq, T] bool: pairs at level v whose key (and query, if queries drop too) survives
    level v's drop."""
    region = (level_of_pair == v).unsqueeze(0)  # [1, Tq, T]
    if keep is None:
        return region
    kq = keep.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, T]
    visible = region & kq.unsqueeze(1)
    return visible & kq[:, q_start:].unsqueeze(-1) if drop_queries else visible


def csa_attention(q, k, v, layout: CsaLayout, keep: list[torch.Tensor], *,
                  drop_queries: bool = True, q_start: int = 0):
    """CSA for one layer of one sharded sequence: queries at positions q_start..T−1 (a chunk;
    0: the whole sequence), keys at 0..T−1 (earlier positions: the chunk's history).

    ``keep`` is ``keep_masks(...)`` over all T positions (empty: drop nothing).
    ``drop_queries`` False keeps every query at every level and drops only keys and values
    (not the paper's rule, which drops Q too; a variant to see where the loss comes from).
    Returns (out [Tq, Hq, D], lse [Hq, Tq], importance [T, Hkv] for the next layer's
    ``keep_masks``, parts) where parts is the per-level [(out_v, lse_v)] merged by Eq. 5."""
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    level_of_pair = layout.level_of_pair(q_start)
    parts = []
    importance = None
    for v_idx in range(LEVELS):
        visible = _level_visible(level_of_pair, v_idx + 1, keep[v_idx] if keep else None, group,
                                 drop_queries, q_start)
        out_v, lse_v, probs = masked_attention_with_lse(q, k, v, visible)
        parts.append((out_v, lse_v))
        if v_idx == 0:
            # Level-1 probabilities normalised within the shard: local to the sender.
            importance = key_importance(probs, hkv)
    out, lse = merge_attention_all(parts)  # Eq. 5
    return out, lse, importance, parts


def key_importance(probs: torch.Tensor, hkv: int) -> torch.Tensor:
    """[Tk, Hkv]: the attention each key received from the queries, summed over the query
    heads of its KV head (notes §1.7.4: H2O-style column sums). probs [Hq, Tq, Tk]."""
    hq, _, tk = probs.shape
    col = probs.sum(dim=1)  # [Hq, Tk]
    return col.reshape(hkv, hq // hkv, tk).sum(dim=1).transpose(0, 1)
