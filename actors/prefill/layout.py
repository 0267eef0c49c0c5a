"""Where a request's KV lives, chunk by chunk: the driver-side bookkeeping of a plan.

Given a validated ``PrefillPlan`` this derives, for every chunk, each member's zigzag share
of the chunk, the cache-balancing moves that precede it, and what every member holds as history
once the moves are done. It is pure (no Ray, no torch), so the layout can be tested and
reasoned about without running a model; the workers trust it and check it against their stores.

Forced plans (``--plan 1500x1,2500x2,4000x4``) are also built here, growing the groups with the
scheduler's topology-aware ``extend``.
"""

from __future__ import annotations

import re

import msgspec

from tetris.actors.prefill.alltoall import resolve_sp_layout
from tetris.actors.prefill.balance import plan_balance
from tetris.actors.prefill.messages import BalanceMode, Move
from tetris.actors.prefill.zigzag import Ranges, normalize_ranges, zigzag_layout
from tetris.plan import SP_LAYOUTS, Chunk, PlanError, PrefillPlan

__all__ = ["ChunkLayout", "plan_layout", "parse_plan_spec", "parse_plan_layouts", "forced_plan"]


class ChunkLayout(msgspec.Struct, frozen=True):
    group: tuple[int, ...]
    chunk_positions: tuple[Ranges, ...]   # per ring member
    history: tuple[Ranges, ...]           # per ring member, after ``moves``
    moves: tuple[Move, ...]


def plan_layout(plan: PrefillPlan, balance: BalanceMode = "overlap",
                cached: dict[int, Ranges] | None = None
                ) -> tuple[list[ChunkLayout], dict[int, Ranges]]:
    """Per-chunk layouts and the final ``instance -> positions`` map of the request's KV.

    Balancing runs only when a chunk's group is larger than the previous one (paper §4.1);
    with ``balance="off"`` history stays where the earlier chunks left it. ``cached``: a
    cached prefix's positions on each of ``plan.cached_instances``, as a chunk already run; a
    moved prefix's (``plan.cached_moved``) on chunk 0's group, which then starts balanced.
    """
    held: dict[int, Ranges] = dict(cached or {})
    prev: tuple[int, ...] = () if not cached else (
        plan.chunks[0].instances if plan.cached_moved else plan.cached_instances)
    layouts = []
    for c in plan.chunks:
        group = c.instances
        if balance != "off" and len(group) > len(prev) and c.start > 0:
            moves, after = plan_balance([held[i] for i in prev], group)
        else:
            moves, after = (), tuple(held.get(i, ()) for i in group)
        chunk = zigzag_layout(c.start, c.end, len(group))
        layouts.append(ChunkLayout(group=group, chunk_positions=chunk, history=after,
                                   moves=moves))
        held = {i: normalize_ranges(list(after[r]) + list(chunk[r])) for r, i in enumerate(group)}
        prev = group
    return layouts, held


# Layouts whose chunks may run over micro-partitions (alltoall_pipeline.py, ring_pipeline.py)
PIPELINED_LAYOUTS = ("a2a", "ring")

_SPEC_ITEM = re.compile(r"^\s*(\d+|rest)\s*x\s*(\d+)\s*(?::\s*([a-z0-9]+)\s*(?:/\s*(\d+)\s*)?)?$")


def parse_plan_spec(spec: str) -> list[tuple[int | None, int]]:
    """``"1500x1,2500x2,restx4"`` -> ``[(1500, 1), (2500, 2), (None, 4)]`` (None: the rest).

    An item may name its chunk's SP layout after a colon (``2500x2:a2a``), and the number of
    micro-partitions of its pipelining after a slash (``2500x2:a2a/4``, ``2500x2:ring/4``); see
    ``parse_plan_layouts``."""
    items = []
    for part in spec.split(","):
        m = _SPEC_ITEM.match(part)
        if not m:
            raise PlanError(f"--plan item {part!r}: expected TOKENSxSP, e.g. 1500x2")
        tokens = None if m.group(1) == "rest" else int(m.group(1))
        items.append((tokens, int(m.group(2))))
    if any(t is None for t, _ in items[:-1]):
        raise PlanError("--plan: only the last chunk may be 'rest'")
    return items


def parse_plan_layouts(spec: str) -> list[tuple[str, int]]:
    """Each item's SP layout and micro-partitions: ``"300x1,restx2:a2a/4"`` ->
    ``[("ring", 1), ("a2a", 4)]`` (default ``("ring", 1)``)."""
    parse_plan_spec(spec)
    out = []
    for part in spec.split(","):
        m = _SPEC_ITEM.match(part)
        lay, micro = m.group(3) or "ring", int(m.group(4) or 1)
        if lay not in SP_LAYOUTS:
            raise PlanError(f"--plan layout {lay!r}: expected one of {', '.join(SP_LAYOUTS)}")
        if micro < 1 or (micro > 1 and lay not in PIPELINED_LAYOUTS):
            raise PlanError(f"--plan {part.strip()!r}: micro-partitions (/M, M >= 1) are for "
                            f"{' and '.join(PIPELINED_LAYOUTS)}")
        out.append((lay, micro))
    return out


def forced_plan(request_id: str, prompt_tokens: int, spec: str, node_of: tuple[int, ...],
                num_kv_heads: int | None = None, num_heads: int | None = None) -> PrefillPlan:
    """A plan with the given chunk sizes and SP sizes; groups grown by the scheduler's extend.

    A chunk asking for "a2a" on a group that does not divide ``num_kv_heads`` runs the ring,
    and its ``sp_layout_reason`` says so (``num_kv_heads`` None: no check here; the worker
    refuses such a chunk)."""
    from tetris.scheduler.extend import GroupBuilder, node_members

    items = parse_plan_spec(spec)
    layouts = parse_plan_layouts(spec)
    builder = GroupBuilder([0.0] * len(node_of), node_members(node_of))
    chunks, pos, chain = [], 0, ()
    for k, (tokens, sp) in enumerate(items):
        end = prompt_tokens if tokens is None else pos + tokens
        chain = chain + (sp,)
        try:
            group = builder.group(chain).members
        except ValueError as e:
            raise PlanError(f"--plan chunk {k}: {e}") from None
        (lay, micro), why = layouts[k], ""
        if num_kv_heads is not None:
            lay, why = resolve_sp_layout(lay, len(group), num_kv_heads, num_heads)
        chunks.append(Chunk(start=pos, end=end, instances=group, sp_layout=lay,
                            sp_layout_reason=why,
                            sp_micro_partitions=micro if lay == layouts[k][0] else 1))
        pos = end
    plan = PrefillPlan(request_id=request_id, prompt_tokens=prompt_tokens, chunks=tuple(chunks),
                       policy="forced")
    if pos != prompt_tokens:
        raise PlanError(f"--plan covers {pos} tokens but the prompt has {prompt_tokens} "
                        "(end it with restxSP to take the remainder)")
    return plan.validate(len(node_of))
