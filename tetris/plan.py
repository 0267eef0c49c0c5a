"""The prefill plan: what the scheduler decides and what the prefill pool executes.

One contract, two clocks: the CDSP scheduler returns a ``PrefillPlan`` without knowing Ray,
torch or the wall clock; the live dispatcher hands it to the prefill pool, and the simulator
replays it against the latency model. Times in a plan are seconds on the caller's clock
(the scheduler only adds latency-model predictions to the queue times it was given).

Invariants (checked by ``PrefillPlan.validate``):

- chunks cover ``[cached_tokens, prompt_tokens)`` in order, without gaps or overlap (a
  cached prefix counts as a chunk already run on ``cached_instances``, unless it is moved to
  the first group: ``cached_moved``);
- each chunk's group contains every instance of the previous chunk's group (groups only grow,
  paper §4.1), and the previous group's members come first in the same order, so ring
  position ``r`` of an old member never changes;
- every chunk has at least one token and one instance.
"""

from __future__ import annotations

import msgspec

__all__ = ["Chunk", "PrefillPlan", "PlanError", "SP_LAYOUTS"]

# How a chunk's group shares attention (CSPS §3.2): "ring" passes KV blocks around the group
# (zigzag ring attention); "a2a" is SP-NTP, DeepSpeed-Ulysses-style all-to-all from sequence
# shards to head shards and back (actors/prefill/alltoall.py). The KV each member stores is the
# same under both, so chunks of one plan may mix them. "sptp" is SP-TP, Megatron-SP all-gather
# before attention and reduce-scatter after (actors/prefill/sptp.py), with the same store.
SP_LAYOUTS = ("ring", "a2a", "sptp")


class PlanError(ValueError):
    """A plan violates its invariants."""


class Chunk(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A contiguous token segment of one prompt, run with ring attention on ``instances``.

    ``start``/``end`` are absolute token positions in the prompt (``end`` exclusive); the
    chunk's history is ``[0, start)``. ``instances`` are prefill-instance indices in ring order.
    """

    start: int
    end: int
    instances: tuple[int, ...]
    expected_start: float = 0.0
    expected_end: float = 0.0
    sp_layout: str = "ring"        # one of SP_LAYOUTS
    sp_layout_reason: str = ""     # why this layout (the chooser's or the fallback's words)
    # The layout's communication time minus the ring's, in the prediction (sp_comm.py); the
    # simulator executes it too (a ring chunk: 0, Eq. 1 alone)
    sp_layout_delta_s: float = 0.0
    # "a2a": three-phase pipelining over this many micro-partitions (1: none); "ring": each
    # step's block sent in this many pieces (actors/prefill/ring_pipeline.py)
    sp_micro_partitions: int = 1

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def history_tokens(self) -> int:
        return self.start

    @property
    def sp_size(self) -> int:
        return len(self.instances)


class PrefillPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request's prefill: its chunks in order, and the scheduler's TTFT estimate."""

    request_id: str
    prompt_tokens: int
    chunks: tuple[Chunk, ...]
    ttft_estimate: float = 0.0
    policy: str = ""
    improvement_rate: float = 0.0
    # Prefix caching: ``[0, cached_tokens)`` is not computed; its KV is the run
    # ``cached_source``'s, on ``cached_instances`` (ring order) as that run's ring left it, and
    # counts as a chunk already run: the first chunk's group starts with those instances.
    # ``cached_moved``: the prefix's KV is moved instead, from ``cached_instances`` to the
    # first chunk's group (spread evenly over it, in ring order) before that chunk runs, so
    # that group need not contain them (a cheaper group than the holders', issue #23 item 2).
    cached_tokens: int = 0
    cached_instances: tuple[int, ...] = ()
    cached_source: str = ""
    cached_moved: bool = False

    @property
    def instances(self) -> tuple[int, ...]:
        """The final (largest) group: every instance that holds part of the request's KV."""
        return self.chunks[-1].instances if self.chunks else ()

    def validate(self, pool_size: int | None = None) -> "PrefillPlan":
        if self.prompt_tokens <= 0:
            raise PlanError(f"plan {self.request_id}: prompt_tokens must be positive")
        if not self.chunks:
            raise PlanError(f"plan {self.request_id}: no chunks")
        if not 0 <= self.cached_tokens < self.prompt_tokens or \
                bool(self.cached_tokens) != bool(self.cached_instances):
            raise PlanError(f"plan {self.request_id}: {self.cached_tokens} cached tokens on "
                            f"{self.cached_instances} for a {self.prompt_tokens}-token prompt")
        if self.cached_moved and not self.cached_tokens:
            raise PlanError(f"plan {self.request_id}: a moved prefix needs cached tokens")
        pos = self.cached_tokens
        # A moved prefix lies on the first group when it starts: nothing to grow from.
        prev: tuple[int, ...] = () if self.cached_moved else self.cached_instances
        for k, c in enumerate(self.chunks):
            if c.start != pos or c.end <= c.start:
                raise PlanError(
                    f"plan {self.request_id}: chunk {k} covers [{c.start}, {c.end}) "
                    f"but should start at {pos} and hold at least one token"
                )
            if not c.instances or len(set(c.instances)) != len(c.instances):
                raise PlanError(f"plan {self.request_id}: chunk {k} needs distinct instances")
            if c.instances[: len(prev)] != prev:
                raise PlanError(
                    f"plan {self.request_id}: chunk {k} group {c.instances} must start with "
                    f"the previous group {prev} (groups only grow)"
                )
            if c.sp_micro_partitions < 1:
                raise PlanError(f"plan {self.request_id}: chunk {k} needs at least one "
                                f"micro-partition, got {c.sp_micro_partitions}")
            if c.sp_layout not in SP_LAYOUTS:
                raise PlanError(f"plan {self.request_id}: chunk {k} layout {c.sp_layout!r} "
                                f"is not one of {SP_LAYOUTS}")
            if pool_size is not None and any(i < 0 or i >= pool_size for i in c.instances):
                raise PlanError(
                    f"plan {self.request_id}: chunk {k} names an instance outside 0..{pool_size - 1}"
                )
            pos, prev = c.end, c.instances
        if pos != self.prompt_tokens:
            raise PlanError(
                f"plan {self.request_id}: chunks cover {pos} of {self.prompt_tokens} tokens"
            )
        return self
