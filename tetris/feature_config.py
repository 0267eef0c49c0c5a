"""The optional tables of the four systems' features in a deployment file (tetris/config.py
decodes the file; these structs are re-exported there):

    [prefix_cache] prefix caching (docs/prefix_cache.md)
    [sp_layout]    CSPS per-chunk SP layouts and their communication constants (docs/csps.md)
    [csa]          CSPS's lossy sparse attention, off by default (docs/csps.md)
    [kunserve]     KunServe's parameter dropping on the decode pool (docs/kunserve.md)

Each is off (or plans exactly as without it) by default.
"""

from __future__ import annotations

import msgspec

__all__ = ["CsaConfig", "KunServeConfig", "PREFIX_PLACEMENTS", "PrefixCacheConfig",
           "SpLayoutConfig"]

PREFIX_PLACEMENTS = ("auto", "extend", "move", "recompute")


class PrefixCacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefix caching (docs/prefix_cache.md): the control plane's index of cached prompt
    blocks. ``block_tokens`` is the hashing granularity (a hit counts whole blocks only);
    ``capacity_blocks`` bounds the indexed blocks, evicted least recently used first."""

    enabled: bool = False
    block_tokens: int = 16
    capacity_blocks: int = 4096
    # finished runs each decode instance keeps the KV of, for a conversation's next turn
    # (tetris/control/decode_kept.py); 0: no decode-side reuse
    decode_runs: int = 0
    # Where a hit's first chunk runs (tetris/scheduler/prefix_plan.py): "auto", the latency
    # model's choice between growing the holders' group ("extend"), moving the prefix's KV to
    # a cheaper group without them ("move") and computing it again ("recompute"); the other
    # values force one option where it is possible (operators pinning a choice, and tests).
    placement: str = "auto"

    def __post_init__(self) -> None:
        if self.placement not in PREFIX_PLACEMENTS:
            raise ValueError(f"prefix_cache.placement must be one of {PREFIX_PLACEMENTS}, "
                             f"got {self.placement!r}")
        if self.decode_runs < 0:
            raise ValueError(f"prefix_cache.decode_runs must be >= 0, got {self.decode_runs}")
        if self.block_tokens <= 0 or self.capacity_blocks < 0:
            raise ValueError("prefix_cache.block_tokens must be positive and capacity_blocks "
                             f">= 0, got {self.block_tokens} and {self.capacity_blocks}")


class SpLayoutConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-chunk SP layout choice (CSPS §3.2, Appendix A; tetris/scheduler/sp_comm.py).

    ``layouts`` are those the chooser may pick; the default, the ring alone, plans exactly as
    before. Bandwidths are per instance (GPU), in GB/s: A100 NVSwitch bus bandwidth inside a
    node (the decode model's B_link), one 200 Gb/s HDR InfiniBand NIC per GPU across nodes."""

    layouts: tuple[str, ...] = ("ring",)
    intra_node_gbps: float = 240.0
    inter_node_gbps: float = 25.0
    message_latency_s: float = 10e-6
    bytes_per_element: int = 2
    # The ring's transfers hide behind its attention steps (Eq. 1's γ·h·l + δ·l²); False
    # charges them in full: an upper bound on what another layout saves.
    ring_overlap: bool = True
    # Micro-partition counts M the chooser may pipeline "ring" and "a2a" chunks over, each
    # chunk its cheapest (scheduler/sp_pipeline.py), e.g. [1, 2, 4, 8]; [1]: never, as before.
    micro_partitions: tuple[int, ...] = (1,)
    # The links the latency profile's Eq. 1 was fitted on (the shipped A100 profiles: the
    # paper's cluster, as above): Eq. 1 holds the ring's communication at these, so a chunk
    # is corrected by (its layout at the links above − the ring at these) (sp_comm.py).
    fit_intra_node_gbps: float = 240.0
    fit_inter_node_gbps: float = 25.0

    def __post_init__(self) -> None:
        if "ring" not in self.layouts or any(x not in ("ring", "a2a", "sptp")
                                             for x in self.layouts):
            raise ValueError(f"sp_layout.layouts must hold 'ring' and may add 'a2a', 'sptp', "
                             f"got {list(self.layouts)}")
        if min(self.intra_node_gbps, self.inter_node_gbps, self.fit_intra_node_gbps,
               self.fit_inter_node_gbps) <= 0 or self.bytes_per_element <= 0:
            raise ValueError("sp_layout bandwidths and bytes_per_element must be positive")
        if not self.micro_partitions or min(self.micro_partitions) < 1:
            raise ValueError("sp_layout.micro_partitions must be counts >= 1, got "
                             f"{list(self.micro_partitions)}")


class CsaConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """CSA, communication-efficient sparse attention (CSPS §3.2.4, Eq. 5; kernels/csa.py).

    LOSSY: with ``enabled`` it drops far tokens from attention, so logits differ from dense
    attention (measured in docs/csps.md, benchmarks/bench_csa_quality.py). Off by default.
    Level 1 (own shard) never drops; ``level3_drop_ratio`` None derives the corrected rule
    1 − p3 = (1 − p2)/2 (notes §1.7.3)."""

    enabled: bool = False
    level2_drop_ratio: float = 0.0
    level3_drop_ratio: float | None = None
    # False: a token dropped at a level loses only its K and V there, its query still attends
    # (not the paper's rule; the ring moves no queries, so it sends the same bytes)
    drop_queries: bool = True

    def __post_init__(self) -> None:
        p3 = self.level3_drop_ratio
        if not 0.0 <= self.level2_drop_ratio < 1.0 or (p3 is not None and not 0.0 <= p3 < 1.0):
            raise ValueError("csa drop ratios must lie in [0, 1), got "
                             f"{self.level2_drop_ratio} and {p3}")


class KunServeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """KunServe on the served decode pool (issue #24, docs/kunserve.md): under KV overload,
    TP-1 decode instances drop layers into pipeline groups, and are restored after."""

    enabled: bool = False
    monitor_s: float = 1.0   # how often the pool checks demand (restore when it fell)
    # whole-model KV blocks a dropped member keeps to land prefilled prompts in (taken from
    # its KV region before the group's blocks are sized); 0: a dropped member takes none
    landing_blocks: int = 0
    # §4.3 lookahead micro-batches: a member cuts its decode batch into micro-batches of equal
    # predicted cost (tetris/scheduler/member_lookahead.py). Off by default: on CPU an extra
    # micro-batch costs more than the overlap saves unless the batch is uneven
    lookahead: bool = False
    # Eq. (2)'s load of one more micro-batch (weights read, launch, hops), in the work of one
    # decode sequence; the count of micro-batches weighs it against the overlap
    lookahead_overhead_seqs: float = 8.0

    def __post_init__(self) -> None:
        if self.monitor_s <= 0:
            raise ValueError(f"kunserve.monitor_s must be positive, got {self.monitor_s}")
        if self.landing_blocks < 0:
            raise ValueError(f"kunserve.landing_blocks must be >= 0, got {self.landing_blocks}")
        if not 0 <= self.lookahead_overhead_seqs < float("inf"):
            raise ValueError("kunserve.lookahead_overhead_seqs must be finite and >= 0, got "
                             f"{self.lookahead_overhead_seqs}")

    def member_lookahead(self) -> float | None:
        """What a group's members get: the load per micro-batch, or None (lookahead off)."""
        return self.lookahead_overhead_seqs if self.lookahead else None
