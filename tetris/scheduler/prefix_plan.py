"""Planning a prompt whose first ``c`` tokens have cached KV (prefix caching, issue #23).

The cached prefix is history (paper Eq. 1's ``γ·h·l`` term): only ``[c, P)`` is computed. Its
KV lies on the instances the source run's last group left it on, ``H`` in ring order, sharded
as that ring left it. Two options, and the latency model picks the earlier TTFT:

- ``extend``: ``H`` is the group of a chunk that has already run, so the plan's first group
  starts with ``H`` in the same ring order (groups only grow, as between chunks); members
  added to ``H`` get their share of the prefix by cache balancing. The search is Algorithms
  1-3 over the pool without ``H``, with every SP size offset by ``|H|`` (size 0 is ``H``
  alone) and the first chunk starting no earlier than ``H`` is free.
- ``recompute``: the cache is ignored and the whole prompt planned as usual, when ``H`` is
  busy long enough that computing the prefix again elsewhere ends sooner by more than θ of
  the cached plan's TTFT (the θ test of Algorithm 2: the option that costs the pool more work
  must gain more than θ).

Simplification: the instances added to ``H`` follow rule 1 of ``extend`` over the rest of the
pool (rule 2's preference for ``H``'s own nodes is not applied to ``H``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tetris.plan import Chunk, PrefillPlan
from tetris.scheduler.cdsp import CdspSearch, SearchResult
from tetris.scheduler.extend import node_members
from tetris.scheduler.pool import PoolState

__all__ = ["PrefixOption", "plan_from_prefix", "usable_prefix"]


class PrefixOption:
    """One option's result: ``plan`` and why (``"extend"`` or ``"recompute"``), and the TTFT
    of the option not taken (``inf`` when unavailable), for ``tetris plan`` to show."""

    __slots__ = ("decision", "other_ttft", "plan")

    def __init__(self, plan: PrefillPlan, decision: str, other_ttft: float):
        self.plan = plan
        self.decision = decision
        self.other_ttft = other_ttft


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
                     improvement_rate: float | None = None) -> PrefixOption:
    """``policy``'s plan for a prompt with ``cached_tokens`` cached on ``holders``; a policy
    that is not a CDSP search (fixed-sp-K) recomputes."""
    plain = policy.plan(request_id, prompt_tokens, now, pool, improvement_rate=improvement_rate)
    cached = usable_prefix(cached_tokens, prompt_tokens)
    if cached <= 0 or not holders or not hasattr(policy, "chunked"):
        return PrefixOption(plain, "recompute", math.inf)
    theta = policy._theta(improvement_rate)
    res = _extend_search(policy, prompt_tokens, cached, holders, now, pool, theta)
    # Recomputing the prefix costs the pool its whole work again: like a larger SP size in
    # Algorithm 2, it must gain more than θ of the cached plan's TTFT (SPEC §3's θ test).
    if res is None or res.ttft - plain.ttft_estimate > theta * res.ttft:
        return PrefixOption(plain, "recompute", math.inf if res is None else res.ttft)
    chunks, pos = [], cached
    for tokens, members, start, end in res.chunks:
        chunks.append(Chunk(pos, pos + tokens, members, start, end))
        pos += tokens
    plan = PrefillPlan(request_id, prompt_tokens, tuple(chunks), ttft_estimate=res.ttft,
                       policy=policy.name, improvement_rate=theta, cached_tokens=cached,
                       cached_instances=tuple(holders), cached_source=source)
    return PrefixOption(plan, "extend", plain.ttft_estimate)
