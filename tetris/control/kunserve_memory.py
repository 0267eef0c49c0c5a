"""KunServe's memory model of a decode instance and its overload monitor (KunServe §3, §4.1).

A decode instance is "the minimal set of GPUs that hold a single copy of the parameters". Its
memory is split into parameters (``num_layers`` decoder layers of ``layer_param_bytes`` each,
plus the embedding, final norm and LM head, which every member of a group keeps) and the KV
region. A KV block holds ``block_size`` tokens of every layer it stores; a member that keeps
only ``held`` of the layers stores ``held`` layers per block, so the same bytes hold more
blocks, and the parameter bytes it no longer holds become KV bytes as well:

    member_blocks(held) = (kv_bytes + (L - held) * layer_param_bytes) // (held * layer_block_bytes)

A request in a group needs its blocks on every member, so a group's capacity is the smallest
member's (the artifact's ``min`` over the group's block managers).

The largest request a unit can take (``request_blocks``) is its capacity where a unit is one
pool of blocks (the simulator). On the served pool (``member_parts``) a request is reserved
on one member, which allocates from its part of the group's blocks only (``split_parts``),
and its prefilled KV lands whole in that member's landing zone of ``landing_blocks``
whole-model blocks (taken from the KV region before the group's blocks are sized): so there
it is the least part, at most the landing zone.

The overload monitor counts demand the Llumnix way KunServe uses: blocks held by running
requests plus those that the head-of-line queued requests need. Overload is that demand
reaching the free KV ("has suffered or is about to suffer"); restore is usage back under half
of the undropped capacity with nothing queued (§4.4). Pure: no torch, no ray.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["InstanceLoad", "InstanceMemory", "OverloadMonitor", "instance_memory"]


class InstanceMemory(msgspec.Struct, frozen=True):
    """Memory of one decode instance (all its TP ranks together), in bytes."""

    num_layers: int
    layer_param_bytes: int      # one decoder layer's weights
    other_param_bytes: int      # embedding, final norm, LM head: kept by every member
    kv_bytes: int               # the KV region before any drop
    layer_block_bytes: int      # K and V of one block of one layer
    block_size: int
    # the served pool: a request allocates from its member's part of a group's blocks, and a
    # dropped member keeps ``landing_blocks`` whole-model blocks to land prefilled KV in
    member_parts: bool = False
    landing_blocks: int = 0

    def __post_init__(self) -> None:
        if min(self.num_layers, self.layer_param_bytes, self.layer_block_bytes,
               self.block_size) <= 0 or min(self.kv_bytes, self.other_param_bytes,
                                            self.landing_blocks) < 0:
            raise ValueError(f"memory sizes must be positive: {self}")

    @property
    def layers_param_bytes(self) -> int:
        """P: the bytes one merge frees (one full copy of the decoder layers)."""
        return self.num_layers * self.layer_param_bytes

    @property
    def param_bytes(self) -> int:
        return self.layers_param_bytes + self.other_param_bytes

    @property
    def block_bytes(self) -> int:
        """One block of every layer: the unit of an undropped instance's KV."""
        return self.num_layers * self.layer_block_bytes

    @property
    def kv_blocks(self) -> int:
        return self.kv_bytes // self.block_bytes

    def member_kv_blocks(self, held_layers: int) -> int:
        """Blocks of a member keeping ``held_layers`` layers (module docstring's formula)."""
        if not 1 <= held_layers <= self.num_layers:
            raise ValueError(f"a member holds 1..{self.num_layers} layers, not {held_layers}")
        freed = (self.num_layers - held_layers) * self.layer_param_bytes
        landing = self.landing_blocks * self.block_bytes if held_layers < self.num_layers else 0
        return (self.kv_bytes + freed - landing) // (held_layers * self.layer_block_bytes)

    def group_kv_blocks(self, held_layers: Sequence[int]) -> int:
        """Blocks a group can give a request: the smallest member's."""
        if sum(held_layers) != self.num_layers:
            raise ValueError(f"a group holds each of the {self.num_layers} layers once, "
                             f"its members hold {list(held_layers)}")
        return min(self.member_kv_blocks(n) for n in held_layers)

    def request_blocks(self, held_layers: Sequence[int]) -> int:
        """The blocks of the largest request a unit (its members holding ``held_layers``)
        can take (module docstring): an undropped instance's capacity; a group's, or, on the
        served pool, its least member part (``split_parts`` of equal instances: the group's
        blocks over the members, rounded down) at most the landing zone (0 without one: a
        dropped member then takes no prefilled KV)."""
        if len(held_layers) == 1:
            return self.kv_blocks
        group = self.group_kv_blocks(held_layers)
        if not self.member_parts:
            return group
        return min(group // len(held_layers), self.landing_blocks)


def instance_memory(*, hidden: int, intermediate: int, num_layers: int, num_heads: int,
                    num_kv_heads: int, head_dim: int, vocab: int, dtype_bytes: int,
                    gpu_bytes: int, num_gpus: int, block_size: int, gpu_util: float = 0.9,
                    qkv_bias: bool = False, tied_embeddings: bool = False) -> InstanceMemory:
    """The memory of a Llama/Qwen-style instance on ``num_gpus`` GPUs of ``gpu_bytes``.

    KV region as the KunServe artifact sizes it: ``gpus * gpu_bytes * util - (1% + params)``.
    """
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    attn = hidden * (q + 2 * kv) + q * hidden + ((q + 2 * kv) if qkv_bias else 0)
    layer = attn + 3 * hidden * intermediate + 2 * hidden
    other = vocab * hidden * (1 if tied_embeddings else 2) + hidden
    layer_bytes, other_bytes = layer * dtype_bytes, other * dtype_bytes
    total = num_gpus * gpu_bytes
    kv_bytes = int(total * gpu_util) - total // 100 - num_layers * layer_bytes - other_bytes
    if kv_bytes <= 0:
        raise ValueError(f"the model's {num_layers * layer_bytes + other_bytes} parameter bytes "
                         f"leave no KV room on {num_gpus} x {gpu_bytes} bytes")
    return InstanceMemory(num_layers=num_layers, layer_param_bytes=layer_bytes,
                          other_param_bytes=other_bytes, kv_bytes=kv_bytes,
                          layer_block_bytes=2 * block_size * kv * dtype_bytes,
                          block_size=block_size)


class InstanceLoad(msgspec.Struct, frozen=True):
    """One instance's (or group's) KV report, in blocks."""

    total_blocks: int
    used_blocks: int            # held by running requests
    growth_blocks: int = 0      # the running requests' next blocks (decodes at a boundary)
    head_queued_blocks: int = 0  # what the head-of-line queued requests need

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    @property
    def demand_blocks(self) -> int:
        """Llumnix's demand: in-process plus head-of-line queued."""
        return self.used_blocks + self.growth_blocks + self.head_queued_blocks


class OverloadMonitor:
    """The global monitor of KunServe's workflow step 1, one decision for the cluster.

    ``overload_usage`` is the artifact's ``oom_rate`` (95%): an instance overloads when its
    demand is at least that share of its capacity and what its queue needs is at least what is
    free (``pending_blocks >= free_blocks``). ``restore_usage`` is §4.4's 50%.
    """

    def __init__(self, *, overload_usage: float = 0.95, restore_usage: float = 0.5) -> None:
        if not 0 < restore_usage < overload_usage <= 1:
            raise ValueError("need 0 < restore_usage < overload_usage <= 1")
        self.overload_usage = overload_usage
        self.restore_usage = restore_usage
        self._loads: dict[int, InstanceLoad] = {}

    def reset(self) -> None:
        """Forget every report (units change when groups form or split)."""
        self._loads.clear()

    def observe(self, instance: int, load: InstanceLoad) -> None:
        self._loads[instance] = load

    def load(self, instance: int) -> InstanceLoad:
        return self._loads[instance]

    def overloaded(self, instance: int) -> bool:
        load = self._loads[instance]
        if load.head_queued_blocks == 0:
            return False
        pending = load.growth_blocks + load.head_queued_blocks
        return (load.demand_blocks >= self.overload_usage * load.total_blocks
                and pending >= load.free_blocks)

    def overloaded_instances(self) -> list[int]:
        return [i for i in sorted(self._loads) if self.overloaded(i)]

    def demand_blocks(self, instances: Sequence[int] | None = None) -> tuple[int, int]:
        """(demand, free) summed over ``instances`` (all reported ones by default)."""
        ids = sorted(self._loads) if instances is None else list(instances)
        return (sum(self._loads[i].demand_blocks for i in ids),
                sum(self._loads[i].free_blocks for i in ids))

    def can_restore(self, undropped_blocks: int, instances: Sequence[int]) -> bool:
        """§4.4: usage under ``restore_usage`` of the undropped capacity, nothing queued."""
        loads = [self._loads[i] for i in instances]
        if any(ld.head_queued_blocks for ld in loads):
            return False
        used = sum(ld.used_blocks + ld.growth_blocks for ld in loads)
        return used <= self.restore_usage * undropped_blocks
