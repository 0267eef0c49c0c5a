"""The prefill pool as the simulator executes it.

The control plane commits a plan to its ``PrefillQueue`` (its belief about queue times); this module
runs the plan on the simulated instances by the pool's own rule, independent of the plan's
expected times: a chunk starts when every member of its group is free and the request's previous
chunk is done, and lasts what the latency model says for ``(sp, history, chunk)``. Instances run
their chunks in commit order (a ring needs all members at once, so nothing overtakes). With an
exact latency model the actual times equal the plan's expectations; ``max_plan_deviation``
records the largest difference so that a run can show it.
"""

from __future__ import annotations

from typing import Callable, Protocol

import msgspec

from tetris.plan import PrefillPlan

__all__ = ["ChunkRun", "PrefillPoolSim", "LatencyFn", "Stall"]


class LatencyFn(Protocol):
    def __call__(self, sp: int, history_tokens: int, chunk_tokens: int) -> float: ...


class ChunkRun(msgspec.Struct, frozen=True):
    """One executed chunk: what ran where and when (actual and planned times)."""

    request_id: str
    index: int
    instances: tuple[int, ...]
    history_tokens: int
    tokens: int
    start: float
    end: float
    expected_start: float
    expected_end: float


class Stall(msgspec.Struct, frozen=True):
    """From ``at`` on, ``instances`` run nothing for ``seconds``: a worker that died and is being
    replaced (the live pool's ``WorldKeeper.reform``), or the instances whose tickets wait
    behind it. Work placed before ``at`` runs as placed; what is placed from ``at`` on starts
    after the stall (``PrefillPoolSim.stall``)."""

    at: float
    instances: tuple[int, ...]
    seconds: float


class PrefillPoolSim:
    """``num_instances`` prefill instances; tracks when each is free and how long it was busy."""

    def __init__(self, num_instances: int, latency: Callable[[int, int, int], float],
                 record: bool = True) -> None:
        if num_instances <= 0:
            raise ValueError("the prefill pool needs at least one instance")
        self.free_at = [0.0] * num_instances
        self.busy_s = [0.0] * num_instances
        self.latency = latency
        self.record = record
        self.runs: list[ChunkRun] = []
        self.max_plan_deviation = 0.0

    def execute(self, plan: PrefillPlan, arrival: float) -> tuple[float, list[ChunkRun]]:
        """Run ``plan``'s chunks in order; returns the prefill end time and the chunk runs."""
        prev_end = arrival
        runs: list[ChunkRun] = []
        free_at, busy = self.free_at, self.busy_s
        for k, c in enumerate(plan.chunks):
            start = max(prev_end, max(free_at[i] for i in c.instances))
            dur = self.latency(len(c.instances), c.start, c.end - c.start)
            # the layout's communication (or its pieces') against the whole-block ring's; a
            # ring's too on links other than those Eq. 1 was fitted on (layout_policy.py)
            if c.sp_layout != "ring" or c.sp_micro_partitions > 1 or c.sp_layout_delta_s:
                dur += c.sp_layout_delta_s
            end = start + dur
            for i in c.instances:
                free_at[i] = end
                busy[i] += dur
            dev = max(abs(start - c.expected_start), abs(end - c.expected_end))
            if dev > self.max_plan_deviation:
                self.max_plan_deviation = dev
            runs.append(ChunkRun(plan.request_id, k, tuple(c.instances), c.start, c.end - c.start,
                                 start, end, c.expected_start, c.expected_end))
            prev_end = end
        if self.record:
            self.runs.extend(runs)
        return prev_end, runs

    def stall(self, instances: tuple[int, ...], until: float) -> None:
        """Nothing placed from now on starts on ``instances`` before ``until``."""
        for i in instances:
            if not 0 <= i < len(self.free_at):
                raise ValueError(f"no prefill instance {i} (pool of {len(self.free_at)})")
            self.free_at[i] = max(self.free_at[i], until)

    def utilisation(self, t0: float, t1: float) -> float:
        """Mean fraction of ``[t0, t1]`` the instances spent computing (all work counted)."""
        span = t1 - t0
        return sum(self.busy_s) / (span * len(self.busy_s)) if span > 0 else 0.0
