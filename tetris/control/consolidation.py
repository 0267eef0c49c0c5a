"""When a sharded decode request is consolidated onto its master (LoongServe §1.5, P/D form).

A request placed as a decode group keeps asking its holders for partials every step (the
query broadcast of CSPS §2.5). Once other requests finish on its master, one of its ranges may
be moved there instead: the KV crosses the link once and that holder leaves the group. The
decision for a range of ``L`` tokens on holder ``h``, master ``m``, ``n`` steps left:

    gain per step   G = sum_i b_i * (t_i - t'_i)          over the group's instances
    cost of moving  C = b_m * L * kv_bytes_per_token / bw  (the master's batch waits)
    move  iff  n * G > C,  i.e.  n > C / G  (never when G <= 0)

``b_i`` is instance ``i``'s batch, ``t_i`` its step with the ranges where they are now and
``t'_i`` with the range on the master: a member's own iteration over the KV it holds (with no
batch of its own, the reads of the ranges it holds), and the master's step is the slowest
member's plus the q/partial exchange of the group (lockstep per layer). So ``G`` holds the
three effects the issue names: the exchange saved (fewer holders), the round-time penalty of
a slow holder lifted off the master's batch, and against them the master's longer reads.
Units are request-seconds: the delay summed over the batches that feel it.

This is LoongServe's scale-down test ``T(E_p) - T(E_p ∪ e) >= V(e)/bw``
(loongserve-notes §1.5) weighted by the batches involved. With reads that cost nothing,
``G = b_m * (exchange(P) - exchange(P - 1))`` and the test is ``ExchangeModel.choose``'s:
query broadcast vs moving the KV (csps-notes §2.5).

Pure: no Ray, no torch, no clock.
"""

from __future__ import annotations

import math

import msgspec

__all__ = ["ConsolidationCost", "consolidation_cost"]


class ConsolidationCost(msgspec.Struct, frozen=True):
    """The model's terms for moving one range onto its master (seconds, request-seconds)."""

    tokens: int
    master_step: float          # the master's modelled step now
    master_step_after: float    # ... with the range on the master
    gain_per_step: float        # G: batch-weighted step time saved per step
    move_cost: float            # C: the copy, paid by the master's batch

    @property
    def break_even_steps(self) -> float:
        """Steps left above which moving pays (inf: query broadcast wins however long)."""
        return self.move_cost / self.gain_per_step if self.gain_per_step > 0 else math.inf

    def worth(self, remaining_steps: int) -> bool:
        return remaining_steps * self.gain_per_step > self.move_cost


def _times(placer, master: int, context: dict[int, int],
           holders: tuple[int, ...]) -> dict[int, float]:
    """Each instance's step over ``context`` KV tokens; the master's waits for the slowest of
    ``holders`` (its group, itself included) and the exchange among them."""
    batch = placer.router.batch_size
    times = {i: placer._instance_time(max(batch[i], int(i == master)), context[i])
             for i in sorted(context)}
    times[master] = max(times[i] for i in holders) + placer.exchange.step_time(len(holders))
    return times


def consolidation_cost(placer, group, moved) -> ConsolidationCost:
    """The cost model for moving range ``moved`` of ``group`` (placed and arrived: its tokens
    are in the members' used slots) onto the group's master, on ``placer``'s router state."""
    master = group.master
    members = group.instances
    context = {i: placer._used(i) for i in members}
    before = _times(placer, master, context, members)
    after_context = dict(context)
    after_context[moved.instance] -= moved.tokens
    after_context[master] += moved.tokens
    leaves = group.tokens_on(moved.instance) == moved.tokens
    after_members = tuple(i for i in members if not (leaves and i == moved.instance))
    after = _times(placer, master, after_context, after_members)
    batch = placer.router.batch_size
    weight = {i: max(batch[i], int(i == master)) for i in members}
    gain = sum(weight[i] * (before[i] - after[i]) for i in members)
    cost = weight[master] * placer.exchange.kv_move_time(moved.tokens)
    return ConsolidationCost(moved.tokens, before[master], after[master], gain, cost)
