"""Decode routing with Llumnix virtual usage (SPEC §5, paper §5.2).

Lifecycle of one request on the router:
1. ``choose(kv_tokens)``: the instance with the highest freeness
   ``(free slots − virtual usage) / active batch size`` among those with room for the request;
2. ``reserve(instance, kv_tokens)``: while its KV is still being transferred, the
   request's slots count as used (virtual usage), so concurrent choices do not pile onto one
   instance whose free-slot count has not caught up yet;
3. ``release(instance, kv_tokens)``: the transfer finished (the instance's next ``update`` accounts for
   the slots) or the request was aborted;
4. ``update(instance, free_slots, batch_size)``: each time an instance returns output.

Slots are KV tokens. The router is pure bookkeeping: no clock, no I/O; the caller remembers
which instance and how many tokens each request reserved.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["DecodeRouter", "NoInstanceUp", "RouterError"]


class RouterError(ValueError):
    """Unknown instance or request, or an invalid slot count."""


class NoInstanceUp(RuntimeError):
    """Every decode instance is marked down (``set_up``): nothing to route to right now."""


class DecodeRouter:
    """Routing state of the decode instances: ``capacities[i]`` KV-token slots each."""

    def __init__(self, capacities: Sequence[int]):
        caps = [int(c) for c in capacities]
        if not caps or min(caps) <= 0:
            raise RouterError(f"a decode router needs instances with positive slots, got {caps}")
        self.free_slots: list[int] = caps
        self.batch_size: list[int] = [0] * len(caps)
        self.virtual: list[int] = [0] * len(caps)
        self.down: set[int] = set()   # instances not to route to (broken, being restarted)

    @property
    def num_instances(self) -> int:
        return len(self.free_slots)

    def freeness(self, instance: int) -> float:
        # An idle instance counts as batch 1: its freeness is then just its free slots.
        return (self.free_slots[instance] - self.virtual[instance]) / max(1, self.batch_size[instance])

    def choose(self, request_kv_tokens: int, avoid: frozenset[int] | set[int] = frozenset()) -> int:
        """The freest instance with room for ``request_kv_tokens``.

        When no instance has room now, the freest one anyway: the request waits in that
        instance's queue rather than being refused. Ties: smaller batch, then lower index.
        Instances marked down are skipped; ``NoInstanceUp`` when that is all of them.
        Instances in ``avoid`` (one that just lost the request) are chosen only when no other
        instance is up.
        """
        if request_kv_tokens < 0:
            raise RouterError(f"request_kv_tokens must be non-negative, got {request_kv_tokens}")
        best, best_key = 0, None
        for i in range(self.num_instances):
            if i in self.down:
                continue
            room = self.free_slots[i] - self.virtual[i] >= request_kv_tokens
            key = (i in avoid, not room, -self.freeness(i), self.batch_size[i], i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        if best_key is None:
            raise NoInstanceUp(f"all {self.num_instances} decode instances are down")
        return best

    def set_up(self, instance: int, up: bool) -> None:
        """Route to ``instance`` again, or stop routing to it (requests already there stay
        booked until released)."""
        self._check(instance)
        (self.down.discard if up else self.down.add)(instance)

    def reserve(self, instance: int, kv_tokens: int) -> None:
        """Count a request's slots as used while its KV is in flight (virtual usage)."""
        self._check(instance)
        if kv_tokens < 0:
            raise RouterError(f"kv_tokens must be non-negative, got {kv_tokens}")
        self.virtual[instance] += kv_tokens

    def release(self, instance: int, kv_tokens: int) -> None:
        """The transfer finished (or the request was aborted): drop its virtual usage."""
        self._check(instance)
        if kv_tokens < 0 or kv_tokens > self.virtual[instance]:
            raise RouterError(
                f"instance {instance} holds {self.virtual[instance]} virtual slots, "
                f"cannot release {kv_tokens}"
            )
        self.virtual[instance] -= kv_tokens

    def update(self, instance: int, free_slots: int, batch_size: int) -> None:
        """Fresh counts from the instance (each time it returns output)."""
        self._check(instance)
        if batch_size < 0:
            raise RouterError("batch_size must be non-negative")
        self.free_slots[instance] = free_slots
        self.batch_size[instance] = batch_size

    def _check(self, instance: int) -> None:
        if not 0 <= instance < self.num_instances:
            raise RouterError(f"no decode instance {instance} (have {self.num_instances})")
