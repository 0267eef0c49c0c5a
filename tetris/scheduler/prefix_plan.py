"""Planning a prompt whose first ``c`` tokens have cached KV (prefix caching, issue #23).

The cached prefix is history (paper Eq. 1's ``γ·h·l`` term): only ``[c, P)`` is computed. Its
KV lies on the instances the source run's last group left it on, ``H`` in ring order, sharded
as that ring left it. Three options, and the latency model picks the earliest TTFT:

- ``extend``: ``H`` is the group of a chunk that has already run, so the plan's first group
  starts with ``H`` in the same ring order (groups only grow, as between chunks); members
  added to ``H`` get their share of the prefix by cache balancing. The search is Algorithms
  1-3 over the pool without ``H``, with every SP size offset by ``|H|`` (size 0 is ``H``
  alone) and the first chunk starting no earlier than ``H`` is free.
- ``move``: a first group without ``H``, chosen by the search over the rest of the pool, gets
  the prefix's KV moved to it from ``H`` before its first chunk starts (prefix_move.py: the
  price on the deployment's links, the search once per first-group size). Offered only with a
  link model (``PrefixMove``) and once the source run's prefill has finished (the holders
  send from their transfer thread while they compute). Against ``extend`` no θ: the compute
  is the same, the move trades link time for a free group.
- ``recompute``: the cache is ignored and the whole prompt planned as usual, when ``H`` is
  busy long enough that computing the prefix again elsewhere ends sooner by more than θ of
  the best cached plan's TTFT (the θ test of Algorithm 2: the option that costs the pool more
  work must gain more than θ).

``placement`` (``[prefix_cache] placement``) forces one option where it is possible; where it
is not (``move`` without a link model, with the source still running or no instance free of
``H``; ``extend`` with no profile SP size holding ``H``) the latency model chooses among the
rest, and ``PrefixOption.reason`` says why.

Simplification: the instances added to ``H`` follow rule 1 of ``extend`` over the rest of the
pool (rule 2's preference for ``H``'s own nodes is not applied to ``H``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tetris.plan import Chunk, PrefillPlan
from tetris.scheduler.cdsp import CdspSearch, SearchResult
from tetris.scheduler.extend import node_members
from tetris.scheduler.layout_policy import LayoutPolicy, assign_layouts, landed_pool
from tetris.scheduler.pool import PoolState
from tetris.scheduler.prefix_move import MoveResult, PrefixMove, move_search

__all__ = ["OPTIONS", "PrefixOption", "plan_from_prefix", "usable_prefix"]


OPTIONS = ("extend", "move", "recompute")


class PrefixOption:
    """The option taken: ``plan`` and ``decision`` (``"extend"``, ``"move"`` or
    ``"recompute"``); every option's TTFT in ``ttfts`` (``inf`` when unavailable, why in
    ``unavailable``), for ``tetris plan`` to show; ``reason`` says why a forced placement was
    not taken (empty otherwise); ``move_s`` and ``move_bytes`` price the move option (0 when
    it was not offered)."""

    __slots__ = ("decision", "move_bytes", "move_s", "plan", "reason", "ttfts", "unavailable")

    def __init__(self, plan: PrefillPlan, decision: str, ttfts: dict[str, float], *,
                 unavailable: dict[str, str] | None = None, reason: str = "",
                 move_s: float = 0.0, move_bytes: float = 0.0):
        self.plan = plan
        self.decision = decision
        self.ttfts = {x: ttfts.get(x, math.inf) for x in OPTIONS}
        self.unavailable = dict(unavailable or {})
        self.reason = reason
        self.move_s = move_s
        self.move_bytes = move_bytes

    @property
    def other_ttft(self) -> float:
        """The best TTFT among the options not taken (``inf`` when none was available)."""
        return min(t for x, t in self.ttfts.items() if x != self.decision)


def usable_prefix(cached_tokens: int, prompt_tokens: int) -> int:
    """At least the last prompt token is computed: its logits give the first token."""
    return max(0, min(cached_tokens, prompt_tokens - 1))


def _extend_search(policy, prompt_tokens: int, cached: int, holders: Sequence[int],
                   now: float, pool: PoolState, theta: float) -> SearchResult | None:
    """The best plan whose first group starts with ``holders`` (members as pool indices,
    holders first), or None when no profile SP size holds ``holders``."""
    h = len(holders)
    held = set(holders)
    rest = [i for i in range(pool.size) if i not in held]
    table = policy.profile.table
    sizes = [s - h for s in policy.sp_candidates if s >= h and s - h <= len(rest)]
    if not sizes:
        return None
    coeffs = {s - h: table[s] for s in policy.sp_candidates if s >= h}
    t0 = max(now, max(pool.queue_times[i] for i in holders))
    remaining = prompt_tokens - cached
    if not rest:
        a, b, g, d = coeffs[0]
        end = t0 + a + remaining * (b + g * cached + d * remaining)   # Eq. 1
        return SearchResult(end - now, [(remaining, tuple(holders), t0, end)])
    queue = [pool.queue_times[i] for i in rest]
    search = CdspSearch(coeffs, sizes, queue, node_members([pool.node_of[i] for i in rest]),
                        now, theta=theta, min_chunk_tokens=policy.min_chunk_tokens,
                        chunk_align=policy.chunk_align)
    root = search.groups.root
    if policy.chunked:
        end, head = search._cdsp(remaining, cached, root, t0, 0, math.inf)
    else:
        end, k, start = search.single_chunk(remaining, cached, root, t0, 0)
        head = (remaining, search.groups.child(root, sizes[k]), start, end, None)
    res = search._result(end, head)
    # Back to pool indices, ``H`` first in its ring order.
    chunks = [(tokens, tuple(holders) + tuple(rest[m] for m in members), start, chunk_end)
              for tokens, members, start, chunk_end in res.chunks]
    return SearchResult(res.ttft, chunks)


def plan_from_prefix(policy, request_id: str, prompt_tokens: int, now: float, pool: PoolState,
                     *, cached_tokens: int, holders: Sequence[int], source: str,
                     improvement_rate: float | None = None, placement: str = "auto",
                     source_ready: bool = True, move: PrefixMove | None = None) -> PrefixOption:
    """``policy``'s plan for a prompt with ``cached_tokens`` cached on ``holders``; a policy
    that is not a CDSP search (fixed-sp-K) recomputes. ``move`` is the link model the move
    option is priced on (None: not offered); ``source_ready``: the source run's prefill has
    finished, so its KV can be sent from ``now`` on."""
    plain = policy.plan(request_id, prompt_tokens, now, pool, improvement_rate=improvement_rate)
    cached = usable_prefix(cached_tokens, prompt_tokens)
    # A LayoutPolicy (CSPS layouts, layout_policy.py) wraps the CDSP search: the options are
    # searched as the ring's and each chunk then gets its layout, as the plain plan did.
    layouts = policy if isinstance(policy, LayoutPolicy) else None
    if layouts is not None:
        policy = layouts.inner
    if cached <= 0 or not holders or not hasattr(policy, "chunked"):
        return PrefixOption(plain, "recompute", {"recompute": plain.ttft_estimate},
                            unavailable={x: "no usable cached prefix, or not a CDSP policy"
                                         for x in ("extend", "move")})
    theta = policy._theta(improvement_rate)
    plans, why = {"recompute": plain}, {}
    res = _extend_search(policy, prompt_tokens, cached, holders, now, pool, theta)
    if res is None:
        why["extend"] = f"no profile SP size holds the {len(holders)} holders"
    else:
        plans["extend"] = _cached_plan(policy, request_id, prompt_tokens, cached, holders,
                                       source, theta, res, moved=False)
    moved, why_move = _move_option(policy, prompt_tokens, cached, holders, now, pool, theta,
                                   move, source_ready)
    if moved is None:
        why["move"] = why_move
    else:
        plans["move"] = _cached_plan(policy, request_id, prompt_tokens, cached, holders,
                                     source, theta, moved.result, moved=True)
    if layouts is not None:
        plans.update({x: assign_layouts(p, layouts.chooser, landed_pool(pool, p), now,
                                        layouts.profile)
                      for x, p in plans.items() if x != "recompute"})
    ttfts = {x: p.ttft_estimate for x, p in plans.items()}
    decision, reason = _choose(ttfts, placement, theta, why)
    return PrefixOption(plans[decision], decision, ttfts, unavailable=why, reason=reason,
                        move_s=moved.move_s if moved is not None else 0.0,
                        move_bytes=move.kv_bytes(cached) if moved is not None else 0.0)


def _move_option(policy, prompt_tokens: int, cached: int, holders: Sequence[int], now: float,
                 pool: PoolState, theta: float, move: PrefixMove | None,
                 source_ready: bool) -> tuple[MoveResult | None, str]:
    """The best moved plan, or None and why it is not offered."""
    if move is None:
        return None, "no link model"
    if not source_ready:
        return None, "the source run is still prefilling"
    found = move_search(policy, prompt_tokens, cached, holders, now, now, pool, theta, move)
    if found is None:
        return None, "no profile SP size fits the instances free of the holders"
    return found, ""


def _choose(ttfts: dict[str, float], placement: str, theta: float,
            why: dict[str, str]) -> tuple[str, str]:
    """The option taken and, for a forced placement not possible, why (module docstring)."""
    if placement in ttfts:
        return placement, ""
    reason = ""
    if placement != "auto":
        reason = (f"{placement} not possible ({why.get(placement, 'unknown placement')}); "
                  "the latency model's choice")
    # Between extend and move no θ: the same compute, earliest first (extend on ties).
    cached = [x for x in ("extend", "move") if x in ttfts]
    if not cached:
        return "recompute", reason
    best = min(cached, key=lambda x: ttfts[x])
    # Recomputing the prefix costs the pool its whole work again: like a larger SP size in
    # Algorithm 2, it must gain more than θ of the cached plan's TTFT (SPEC §3's θ test).
    if ttfts[best] - ttfts["recompute"] > theta * ttfts[best]:
        return "recompute", reason
    return best, reason


def _cached_plan(policy, request_id: str, prompt_tokens: int, cached: int,
                 holders: Sequence[int], source: str, theta: float, res: SearchResult, *,
                 moved: bool) -> PrefillPlan:
    chunks, pos = [], cached
    for tokens, members, start, end in res.chunks:
        chunks.append(Chunk(pos, pos + tokens, members, start, end))
        pos += tokens
    return PrefillPlan(request_id, prompt_tokens, tuple(chunks), ttft_estimate=res.ttft,
                       policy=policy.name, improvement_rate=theta, cached_tokens=cached,
                       cached_instances=tuple(holders), cached_source=source,
                       cached_moved=moved)
