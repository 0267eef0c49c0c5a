"""KunServe's lookahead micro-batch formation (§4.3) and its attention-aware cost model.

In a pipeline, a micro-batch slower than the one before it leaves the next stage idle (a
bubble). Under a burst many requests are queued, so the scheduler looks at all queued tokens
at once and splits them recursively into micro-batches of equal predicted cost, cutting a
request into chunks where needed; a chunk after the first attends to the earlier ones, so its
``prefix`` is their length. Splitting stops when a half would hold fewer than
``min_tokens`` tokens (the GPU needs enough tokens per micro-batch) or ``max_batches`` are
formed (any count, not only a power of two: a part meant for k micro-batches is cut at
floor(k/2) / k of its cost). Token counts alone do not balance cost: attention is quadratic in a request's length.

Cost model, Eq. (1)-(2) (reconstructed in research/kunserve-notes.md §1.4, the extraction
dropped the formulas), fitted by least squares on profiled (chunks, seconds) samples:

    Cost(c) = alpha * p_c * l_c + beta * l_c**2 + gamma * l_c + delta      (1)
    Cost(b) = sum_{c in b} Cost(c) - (|b| - 1) * epsilon                   (2)

``epsilon`` is the parameter loading the chunks of one batch share. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

__all__ = ["Chunk", "CostModel", "bubble_share", "lookahead", "token_budget_batches"]


class Chunk(msgspec.Struct, frozen=True):
    """``length`` new tokens of ``request`` after ``prefix`` tokens already computed."""

    request: str
    prefix: int
    length: int


class CostModel(msgspec.Struct, frozen=True):
    alpha: float
    beta: float
    gamma: float
    delta: float
    epsilon: float = 0.0

    def chunk(self, c: Chunk) -> float:
        """Eq. (1)."""
        return (self.alpha * c.prefix * c.length + self.beta * c.length * c.length
                + self.gamma * c.length + self.delta)

    def batch(self, chunks: Sequence[Chunk]) -> float:
        """Eq. (2)."""
        if not chunks:
            return 0.0
        return sum(self.chunk(c) for c in chunks) - (len(chunks) - 1) * self.epsilon

    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[Chunk], float]]) -> CostModel:
        """Least squares over (micro-batch, measured seconds) samples.

        Eq. (2) is linear in (alpha, beta, gamma, delta - epsilon, epsilon) with features
        (sum p*l, sum l^2, sum l, |b|, 1).
        """
        rows = [[sum(c.prefix * c.length for c in b), sum(c.length ** 2 for c in b),
                 sum(c.length for c in b), len(b), 1.0] for b, _ in samples]
        y = np.array([t for _, t in samples])
        coef, *_ = np.linalg.lstsq(np.array(rows, dtype=float), y, rcond=None)
        a, b, g, d_minus_e, e = (float(x) for x in coef)
        return cls(a, b, g, d_minus_e + e, e)


def _tokens(mb: Sequence[Chunk]) -> int:
    return sum(c.length for c in mb)


def _cut(model: CostModel, done: float, n_done: int, c: Chunk, target: float) -> int:
    """Largest n in [0, c.length] with Cost(done + c[:n]) <= target (cost grows with n);
    ``done`` is the sum of Eq. (1) over the ``n_done`` chunks already taken."""
    lo, hi = 0, c.length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        part = model.chunk(Chunk(c.request, c.prefix, mid))
        if done + part - n_done * model.epsilon <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _split(model: CostModel, mb: list[Chunk], target: float) -> tuple[list[Chunk], list[Chunk]]:
    """Cut ``mb`` (in order) where the left part's cost reaches ``target``. The left part's
    Eq. (2) is kept as a running sum (linear in the chunks, not quadratic)."""
    left: list[Chunk] = []
    done = 0.0                     # sum of Eq. (1) over ``left``
    for i, c in enumerate(mb):
        cost = model.chunk(c)
        if done + cost - len(left) * model.epsilon <= target:
            left.append(c)
            done += cost
            continue
        n = _cut(model, done, len(left), c, target)
        right = mb[i + 1:]
        if n == 0:
            return left, [c, *right]
        return ([*left, Chunk(c.request, c.prefix, n)],
                [Chunk(c.request, c.prefix + n, c.length - n), *right])
    return left, []


def lookahead(queued: Sequence[Chunk], model: CostModel, *, min_tokens: int,
              max_batches: int) -> list[list[Chunk]]:
    """§4.3: divide and conquer of all queued tokens into cost-balanced micro-batches.

    A part meant to become k micro-batches is cut in two, in order, for floor(k/2) and the
    rest, where the left part's cost makes every final micro-batch equally costly: splitting
    adds a micro-batch and so one more Eq. (2) ``delta - epsilon``; with k micro-batches of
    equal cost ``c``, ``k c = Cost(part) + (k - 1) epsilon``, and the left part (k1 of them)
    costs ``k1 c - (k1 - 1) epsilon``. (Halving at ``Cost(part) / 2`` instead leaves the
    right half one ``epsilon``, the weights' loading, costlier.) A part holding fewer than
    ``2 * min_tokens`` tokens stays whole.
    """
    def form(mb: list[Chunk], k: int) -> list[list[Chunk]]:
        if k <= 1 or _tokens(mb) < 2 * min_tokens:
            return [mb]
        k1 = k // 2
        per = (model.batch(mb) + (k - 1) * model.epsilon) / k
        left, right = _split(model, mb, k1 * per - (k1 - 1) * model.epsilon)
        if not left or not right:
            return [mb]
        return form(left, k1) + form(right, k - k1)
    return form(list(queued), max_batches)


def token_budget_batches(queued: Sequence[Chunk], budget: int) -> list[list[Chunk]]:
    """The Sarathi/vLLM baseline: fill each micro-batch with ``budget`` tokens, chunking the
    request that overflows it."""
    out: list[list[Chunk]] = [[]]
    room = budget
    for c in queued:
        prefix, left = c.prefix, c.length
        while left:
            if room == 0:
                out.append([])
                room = budget
            n = min(left, room)
            out[-1].append(Chunk(c.request, prefix, n))
            prefix, left, room = prefix + n, left - n, room - n
    return [b for b in out if b]


def bubble_share(batches: Sequence[Sequence[Chunk]], model: CostModel) -> float:
    """Idle share of a pipeline stage when each runs the slowest micro-batch's time per slot:
    ``sum(max - t_i) / (n * max)``."""
    times = [model.batch(b) for b in batches]
    slowest = max(times)
    return sum(slowest - t for t in times) / (len(times) * slowest)
