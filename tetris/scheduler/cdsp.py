"""CDSP search: paper Algorithms 1-3 and Eq. 2 (SPEC §3) over one snapshot of the pool.

Times are absolute on the caller's clock; the search starts at the request's arrival ``now``
(an instance whose queue time is in the past starts at ``now``), and a TTFT is the last
chunk's end minus ``now``. A decision:

    Algorithm 2  single_chunk: every remaining token as one chunk; SP size grows only while the
                 TTFT gain exceeds θ·best (this also caps the SP size of the search, s_max).
    Algorithm 3  solve_chunk:  fill the gap until the larger group G_next is free with a chunk
                 on G_cur: T_{s_cur}(h, l) = max_{G_next} q − max_{G_cur} q, solved for l.
    Algorithm 1  cdsp:         for every pair s_cur < s_next <= s_max, solve the chunk, apply
                 Eq. 2 (G_cur busy until the chunk ends) and recurse on the rest with sizes
                 >= s_next; keep the plan whose last chunk ends first.

Speed (the simulator plans thousands of requests): Eq. 2 is carried as one number, the end of
the previous chunk ``t_prev`` (every member of the current group is busy until then, and no
other queue time changes), groups come from ``GroupBuilder`` (one object per distinct instance
set, extensions memoised on it; ring orders only for the chosen plan), a plan under construction
is a linked tuple, and a branch is cut as soon as its first chunk ends after the best TTFT found
so far (its rest can only end later, so the result is the exhaustive search's).
"""

from __future__ import annotations

import math
from typing import Sequence

from tetris.scheduler.extend import Group, GroupBuilder

__all__ = ["SearchResult", "CdspSearch"]

# A chunk under construction: (tokens, group, start, end, next chunk).
_Link = tuple


class SearchResult:
    """A plan: ``chunks`` as (tokens, members, start, end) in absolute times, and the TTFT."""

    __slots__ = ("ttft", "chunks")

    def __init__(self, ttft: float, chunks: list[tuple[int, tuple[int, ...], float, float]]):
        self.ttft = ttft
        self.chunks = chunks


class CdspSearch:
    """One decision's search state: coefficients, candidate SP sizes and a group builder."""

    __slots__ = ("coeffs", "sizes", "groups", "now", "theta", "min_chunk", "align", "sorted_q")

    def __init__(self, coeffs: dict[int, tuple[float, float, float, float]],
                 sizes: Sequence[int], queue: Sequence[float],
                 topology: list[tuple[int, list[int]]], now: float,
                 *, theta: float, min_chunk_tokens: int, chunk_align: int):
        self.coeffs = coeffs
        self.sizes = tuple(sizes)
        self.groups = GroupBuilder(queue, topology)
        self.now = now
        self.theta = theta
        self.min_chunk = max(1, min_chunk_tokens)
        self.align = max(1, chunk_align)
        self.sorted_q = sorted(queue)  # lower bounds on when k more instances can start

    # ---- Algorithm 2 ----------------------------------------------------------------------

    def single_chunk(self, remaining: int, history: int, g_prev: Group,
                     t_prev: float, lo: int) -> tuple[float, int, float]:
        """Best single chunk from size index ``lo``: (end, size index, start)."""
        sizes, coeffs, theta, now = self.sizes, self.coeffs, self.theta, self.now
        children, child = g_prev.children, self.groups.child
        sorted_q, base = self.sorted_q, g_prev.size
        floor = t_prev if t_prev > g_prev.max_queue else g_prev.max_queue
        best_ttft = math.inf
        best_k = -1
        best_start = 0.0
        for k in range(lo, len(sizes)):
            s = sizes[k]
            a, b, g, d = coeffs[s]
            work = remaining * (b + g * history + d * remaining)
            if best_k >= 0:
                # The s - |G_prev| instances added wait at least as long as the pool's
                # (s - |G_prev|)-th shortest queue; if even that start cannot pass the θ test,
                # the group need not be built (float addition is monotone: the bound is safe).
                lb = sorted_q[s - base - 1]
                if best_ttft - ((lb if lb > floor else floor) + a + work) <= theta * (best_ttft - now):
                    continue
            grp = children.get(s) or child(g_prev, s)
            mq = grp.max_queue
            start = t_prev if t_prev > mq else mq
            ttft = start + a + work
            # A larger SP size must gain more than θ of the best TTFT so far (SPEC §3);
            # TTFTs count from the arrival, hence `- now`.
            if best_k < 0 or best_ttft - ttft > theta * (best_ttft - now):
                best_ttft, best_k, best_start = ttft, k, start
        return best_ttft, best_k, best_start

    def single_chunk_plan(self, prompt_tokens: int) -> SearchResult:
        root = self.groups.root
        ttft, k, start = self.single_chunk(prompt_tokens, 0, root, self.now, 0)
        return self._result(ttft, (prompt_tokens, self.groups.child(root, self.sizes[k]), start,
                                   ttft, None))

    def options(self, prompt_tokens: int) -> list[tuple[int, tuple[int, ...], float, float]]:
        """Every single-chunk alternative: (sp, members, start, end), for explaining a plan."""
        out = []
        builder = self.groups
        for s in self.sizes:
            g = builder.child(builder.root, s)
            start = max(self.now, g.max_queue)
            a, b, _, d = self.coeffs[s]
            out.append((s, builder.ring([g])[0], start,
                        start + a + prompt_tokens * (b + d * prompt_tokens)))
        return out

    # ---- Algorithms 1 and 3 ---------------------------------------------------------------

    def plan(self, prompt_tokens: int) -> SearchResult:
        ttft, head = self._cdsp(prompt_tokens, 0, self.groups.root, self.now, 0, math.inf)
        return self._result(ttft, head)

    def _cdsp(self, remaining: int, history: int, g_prev: Group, t_prev: float,
              lo: int, bound: float) -> tuple[float, _Link]:
        best_ttft, k_max, start = self.single_chunk(remaining, history, g_prev, t_prev, lo)
        best: _Link = (remaining, g_prev.children[self.sizes[k_max]], start, best_ttft, None)
        if k_max == lo:  # one candidate left up to s_max: no pair to chunk with
            return best_ttft, best
        sizes, coeffs, child = self.sizes, self.coeffs, self.groups.child
        min_chunk, align, last = self.min_chunk, self.align, len(sizes) - 1
        for i in range(lo, k_max):
            s_cur = sizes[i]
            g_cur = g_prev.children.get(s_cur) or child(g_prev, s_cur)
            mq_cur = g_cur.max_queue
            start_cur = t_prev if t_prev > mq_cur else mq_cur
            a, b, g, d = coeffs[s_cur]
            lin = b + g * history
            for j in range(i + 1, k_max + 1):
                # Algorithm 3: the budget is the wait until the larger group is free.
                s_next = sizes[j]
                g_next = g_cur.children.get(s_next) or child(g_cur, s_next)
                mq_next = g_next.max_queue
                budget = (t_prev if t_prev > mq_next else mq_next) - start_cur - a
                if budget <= 0.0:
                    continue
                tokens = 2.0 * budget / (lin + math.sqrt(lin * lin + 4.0 * d * budget))
                tokens = int(tokens // align) * align
                if tokens < min_chunk or tokens >= remaining:
                    continue
                end = start_cur + a + tokens * (lin + d * tokens)
                cut = bound if bound < best_ttft else best_ttft
                if end >= cut:
                    continue
                rest_tokens, rest_history = remaining - tokens, history + tokens
                if j == last:
                    # The rest can only be one chunk on G_next: Algorithm 2 with one candidate,
                    # evaluated here as the recursion would (same operations, same floats).
                    a2, b2, g2, d2 = coeffs[s_next]
                    start2 = end if end > mq_next else mq_next
                    rest_ttft = start2 + a2 + rest_tokens * (b2 + g2 * rest_history
                                                             + d2 * rest_tokens)
                    if rest_ttft < best_ttft:
                        best_ttft = rest_ttft
                        best = (tokens, g_cur, start_cur, end,
                                (rest_tokens, g_next, start2, rest_ttft, None))
                    continue
                # Eq. 2: every member of G_cur is busy until this chunk's end.
                rest_ttft, rest = self._cdsp(rest_tokens, rest_history, g_cur, end, j, cut)
                if rest_ttft < best_ttft:
                    best_ttft = rest_ttft
                    best = (tokens, g_cur, start_cur, end, rest)
        return best_ttft, best

    def _result(self, end: float, link: _Link | None) -> SearchResult:
        steps = []
        while link is not None:
            tokens, group, start, chunk_end, link = link
            steps.append((tokens, group, start, chunk_end))
        # A plan's chunk groups are one chain (each grows the previous), as ``ring`` expects.
        rings = self.groups.ring([g for _, g, _, _ in steps])
        chunks = [(tokens, members, start, chunk_end)
                  for (tokens, _, start, chunk_end), members in zip(steps, rings)]
        return SearchResult(end - self.now, chunks)
