"""Each chunk of a plan on its cheapest SP layout, with Eq. 1's times corrected for it.

``assign_layouts`` takes a plan the CDSP search made (chunk lengths and groups chosen under
Eq. 1, i.e. the ring), picks every chunk's layout with a ``LayoutChooser`` (sp_comm.py), and
re-times the chunks: a chunk takes ``T_s(h, l) + Δ_layout`` (``chunk_seconds``) and starts when the previous chunk
has ended and its group is free (Eq. 2 on the same snapshot the search used). Chunk boundaries
are not searched again under the new costs: a faster layout only ends chunks earlier.

With ``[sp_layout] micro_partitions`` (opt-in) the chooser also prices ``ring/M`` and ``a2a/M``
(sp_pipeline.py: piece ``m+1``'s transfer behind piece ``m``'s attention, the first piece's
not hidden, each extra piece a fixed overhead) and the chunk gets the cheapest ``M`` in
``Chunk.sp_micro_partitions``, which the executors run (ring_pipeline.py, alltoall_pipeline.py).

A ring-only chooser without micro-partitions, on the links the profile was fitted on, returns
the plan object it was given, so the default deployment plans bit for bit as before; on other
links its ring chunks are corrected too (``T_ring(deployment) − T_ring(fit)``). ``LayoutPolicy`` wraps any policy with it;
``with_layout_choice`` does so from a deployment (the live dispatcher's policy).
"""

from __future__ import annotations

import msgspec

from tetris.plan import PrefillPlan
from tetris.scheduler.latency import PrefillLatencyModel
from tetris.scheduler.pool import PoolState
from tetris.scheduler.sp_comm import LayoutChoice, LayoutChooser, ModelGeometry

__all__ = ["LayoutPolicy", "assign_layouts", "attention_seconds", "chunk_seconds",
           "landed_pool", "needs_layout_choice", "with_layout_choice"]


def assign_layouts(plan: PrefillPlan, chooser: LayoutChooser, pool: PoolState, now: float,
                   profile: PrefillLatencyModel) -> PrefillPlan:
    """``plan`` with every chunk's layout, reason and times (``profile``: Eq. 1)."""
    if chooser.ring_only:
        return plan
    chunks, t_prev, changed = [], now, False
    for c in plan.chunks:
        pick = chooser.choose(c.instances, pool.node_of, c.start, c.tokens,
                              attention_seconds(profile, c.sp_size, c.start, c.tokens))
        t_s = profile.predict(c.sp_size, c.start, c.tokens)
        _, delta = chunk_seconds(t_s, pick)
        if (pick.layout == "ring" and pick.micro_partitions == 1 and delta == 0.0
                and not changed):
            chunks.append(msgspec.structs.replace(c, sp_layout_reason=pick.reason))
            t_prev = c.expected_end
            continue
        changed = True
        busy = max(pool.queue_times[i] for i in c.instances)
        start = max(t_prev, busy)
        end = start + t_s + delta
        chunks.append(msgspec.structs.replace(c, expected_start=start, expected_end=end,
                                              sp_layout=pick.layout, sp_layout_reason=pick.reason,
                                              sp_layout_delta_s=delta,
                                              sp_micro_partitions=pick.micro_partitions))
        t_prev = end
    ttft = chunks[-1].expected_end - now if changed else plan.ttft_estimate
    return msgspec.structs.replace(plan, chunks=tuple(chunks), ttft_estimate=ttft)


def chunk_seconds(eq1_s: float, pick: LayoutChoice) -> tuple[float, float]:
    """The chunk's compute-only seconds and its delta over Eq. 1 (sp_comm.py's module
    docstring): Eq. 1 (``eq1_s``) holds the ring's exposed communication on the fitted links
    (``pick.ring_fit_s``); the chunk runs its compute plus its own layout's ``pick.comm_s`` on
    the deployment's links. Eq. 1 cannot hold more ring than its whole time: where the cost
    model's fitted ring exceeds it (long history, short chunk: Eq. 1's history term is
    attention only, SPEC §2), the profile's ring was faster than modelled and the compute is
    taken as 0, so the prediction is never below the compute and never negative."""
    if pick.ring_fit_s <= eq1_s:   # the chooser's own delta, bit for bit
        return eq1_s - pick.ring_fit_s, pick.delta_s
    return 0.0, pick.comm_s - eq1_s


def attention_seconds(profile: PrefillLatencyModel, sp: int, history: int, tokens: int) -> float:
    """Eq. 1's attention terms, γ·h·l + δ·l²: what a ring step's transfer can hide behind."""
    _, _, g, d = profile.table[sp]
    return tokens * (g * history + d * tokens)


def with_layout_choice(policy, deployment):
    """``policy`` as the deployment's ``[sp_layout]`` says: itself for the unpipelined ring
    only, else a ``LayoutPolicy`` over the model's per-instance geometry and the policy's own
    profile."""
    cfg = deployment.sp_layout
    if not needs_layout_choice(cfg):
        return policy
    geometry = ModelGeometry.from_model_config(deployment.model, deployment.prefill.tp_size)
    return LayoutPolicy(policy, LayoutChooser.from_config(cfg, geometry), policy.profile)


def needs_layout_choice(cfg) -> bool:
    """Whether a ``SpLayoutConfig`` changes any plan: another layout, pieces, or links other
    than those Eq. 1 was fitted on."""
    return (cfg.layouts != ("ring",) or cfg.micro_partitions != (1,)
            or (cfg.intra_node_gbps, cfg.inter_node_gbps)
            != (cfg.fit_intra_node_gbps, cfg.fit_inter_node_gbps))


def landed_pool(pool: PoolState, plan: PrefillPlan) -> PoolState:
    """The pool ``assign_layouts`` re-times ``plan`` on: for a prefix moved to its first
    group (``cached_moved``), that group is not free before the move has landed (the first
    chunk's planned start)."""
    if not plan.cached_moved:
        return pool
    first = set(plan.chunks[0].instances)
    start = plan.chunks[0].expected_start
    return PoolState([max(q, start) if i in first else q for i, q in enumerate(pool.queue_times)],
                     pool.node_of)


class LayoutPolicy:
    """A policy whose plans carry per-chunk layouts (``assign_layouts``)."""

    def __init__(self, inner, chooser: LayoutChooser, profile: PrefillLatencyModel) -> None:
        self.inner = inner
        self.name = inner.name
        self.chooser = chooser
        self.profile = profile

    def plan(self, request_id: str, prompt_tokens: int, now: float, pool: PoolState,
             improvement_rate: float | None = None) -> PrefillPlan:
        plan = self.inner.plan(request_id, prompt_tokens, now, pool, improvement_rate)
        return assign_layouts(plan, self.chooser, pool, now, self.profile)
