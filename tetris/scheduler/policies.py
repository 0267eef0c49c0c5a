"""Prefill policies: Tetris CDSP and the paper's baselines (SPEC §8), behind one ``Policy`` API.

| name                  | plan                                                              |
| --------------------- | ----------------------------------------------------------------- |
| tetris                | Algorithms 1-3 (chunked), θ per call or the policy's default      |
| tetris-single-chunk   | Algorithm 2 only (the paper's chunking ablation)                  |
| loongserve-disagg     | one chunk, SP size minimising the request's own TTFT (θ = 0)      |
| fixed-sp-K            | fixed co-located groups of K; the group with the lowest queue + T |

A policy reads a ``PoolState`` and returns a ``PrefillPlan`` with absolute times on the
caller's clock; it never mutates the pool (the caller commits the plan it dispatches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from tetris.plan import Chunk, PrefillPlan
from tetris.scheduler.cdsp import CdspSearch, SearchResult
from tetris.scheduler.extend import node_members
from tetris.scheduler.latency import PrefillLatencyModel
from tetris.scheduler.pool import PoolState

if TYPE_CHECKING:
    from tetris.config import SchedulerConfig

__all__ = [
    "Policy",
    "PolicyError",
    "CdspPolicy",
    "FixedSpPolicy",
    "make_policy",
    "policy_from_config",
    "policy_names",
    "DEFAULT_MIN_CHUNK_TOKENS",
    "DEFAULT_CHUNK_ALIGN",
]

# A chunk shorter than this cannot pay back its fixed cost α (and kernel launch) on a ring.
DEFAULT_MIN_CHUNK_TOKENS = 256
# Chunk lengths are rounded down to a multiple of 64 tokens: attention kernels tile by 64/128,
# and rounding down keeps a chunk inside its latency budget.
DEFAULT_CHUNK_ALIGN = 64


class PolicyError(ValueError):
    """Unknown policy name or invalid policy parameters."""


@runtime_checkable
class Policy(Protocol):
    name: str

    def plan(self, request_id: str, prompt_tokens: int, now: float, pool: PoolState,
             improvement_rate: float | None = None) -> PrefillPlan: ...


def _check_request(prompt_tokens: int) -> None:
    if not isinstance(prompt_tokens, int) or prompt_tokens <= 0:
        raise PolicyError(f"prompt_tokens must be a positive int, got {prompt_tokens!r}")


def _to_plan(request_id: str, prompt_tokens: int, now: float, res: SearchResult,
             policy: str, theta: float) -> PrefillPlan:
    chunks = []
    pos = 0
    for tokens, members, start, end in res.chunks:
        chunks.append(Chunk(pos, pos + tokens, members, start, end))
        pos += tokens
    return PrefillPlan(request_id, prompt_tokens, tuple(chunks), ttft_estimate=res.ttft,
                       policy=policy, improvement_rate=theta)


class CdspPolicy:
    """Tetris (``chunked=True``) or its single-chunk ablation; θ = 0 single-chunk is LoongServe-disagg."""

    def __init__(self, name: str, profile: PrefillLatencyModel, *, chunked: bool,
                 sp_candidates: Sequence[int] | None = None,
                 min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS,
                 chunk_align: int = DEFAULT_CHUNK_ALIGN, improvement_rate: float = 0.3,
                 fixed_improvement_rate: bool = False):
        _check_theta(improvement_rate)
        if min_chunk_tokens < 1 or chunk_align < 1:
            raise PolicyError("min_chunk_tokens and chunk_align must be at least 1")
        self.name = name
        self.profile = profile
        self.chunked = chunked
        self.min_chunk_tokens = min_chunk_tokens
        self.chunk_align = chunk_align
        self.improvement_rate = improvement_rate
        self.fixed_improvement_rate = fixed_improvement_rate
        cands = profile.sp_sizes if sp_candidates is None else tuple(sorted(set(sp_candidates)))
        missing = [s for s in cands if s not in profile.table]
        if missing or not cands:
            raise PolicyError(
                f"SP candidates {list(cands)}: profile {profile.name!r} has no coefficients for "
                f"{missing or 'an empty set'} (it has {list(profile.sp_sizes)})"
            )
        self.sp_candidates: tuple[int, ...] = tuple(cands)
        self._layout: tuple[tuple[int, ...], list] = ((), [])  # node_of -> node_members, cached

    def search(self, prompt_tokens: int, now: float, pool: PoolState,
               improvement_rate: float | None = None) -> CdspSearch:
        """The decision's search state (also used by ``tetris plan`` to explain a plan)."""
        theta = self._theta(improvement_rate)
        sizes = [s for s in self.sp_candidates if s <= pool.size]
        if not sizes:
            raise PolicyError(
                f"no SP candidate {list(self.sp_candidates)} fits a pool of {pool.size}"
            )
        node_of, topology = self._layout
        if pool.node_of is not node_of and pool.node_of != node_of:
            topology = node_members(pool.node_of)
            self._layout = (pool.node_of, topology)
        return CdspSearch(self.profile.table, sizes, pool.queue_times, topology, now,
                          theta=theta, min_chunk_tokens=self.min_chunk_tokens,
                          chunk_align=self.chunk_align)

    def plan(self, request_id: str, prompt_tokens: int, now: float, pool: PoolState,
             improvement_rate: float | None = None) -> PrefillPlan:
        _check_request(prompt_tokens)
        theta = self._theta(improvement_rate)
        search = self.search(prompt_tokens, now, pool, theta)
        res = search.plan(prompt_tokens) if self.chunked else search.single_chunk_plan(prompt_tokens)
        return _to_plan(request_id, prompt_tokens, now, res, self.name, theta)

    def _theta(self, improvement_rate: float | None) -> float:
        if improvement_rate is None or self.fixed_improvement_rate:
            return self.improvement_rate
        _check_theta(improvement_rate)
        return improvement_rate


class FixedSpPolicy:
    """The pool cut into fixed groups of ``k`` consecutive instances (co-located on nodes)."""

    def __init__(self, k: int, profile: PrefillLatencyModel):
        if k not in profile.table:
            raise PolicyError(
                f"fixed-sp-{k}: profile {profile.name!r} has no SP size {k} "
                f"(it has {list(profile.sp_sizes)})"
            )
        self.name = f"fixed-sp-{k}"
        self.k = k
        self.profile = profile
        self._groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}

    def groups(self, pool: PoolState) -> list[tuple[int, ...]]:
        g = self._groups.get(pool.node_of)
        if g is None:
            if self.k > pool.size:
                raise PolicyError(f"{self.name} needs at least {self.k} prefill instances; the "
                                  f"pool has {pool.size} (use fixed-sp-<k> with k <= {pool.size})")
            if pool.size % self.k:
                raise PolicyError(f"{self.name}: the pool of {pool.size} instances cannot be cut "
                                  f"into groups of {self.k}")
            order = sorted(range(pool.size), key=lambda i: (pool.node_of[i], i))
            g = [tuple(order[j:j + self.k]) for j in range(0, pool.size, self.k)]
            self._groups[pool.node_of] = g
        return g

    def plan(self, request_id: str, prompt_tokens: int, now: float, pool: PoolState,
             improvement_rate: float | None = None) -> PrefillPlan:
        _check_request(prompt_tokens)
        q = pool.queue_times
        # T_k(0, L) is the same for every group, so the lowest queue wins; ties: lowest group.
        best = min(self.groups(pool), key=lambda g: max(q[i] for i in g))
        start = max(now, max(q[i] for i in best))
        end = start + self.profile.predict(self.k, 0, prompt_tokens)
        chunk = Chunk(0, prompt_tokens, best, start, end)
        return PrefillPlan(request_id, prompt_tokens, (chunk,), ttft_estimate=end - now,
                           policy=self.name, improvement_rate=0.0)


def _check_theta(theta: float) -> None:
    if not 0.0 <= theta < 1.0:
        raise PolicyError(f"improvement_rate must be in [0, 1), got {theta}")


def policy_names() -> list[str]:
    return ["tetris", "tetris-single-chunk", "loongserve-disagg", "fixed-sp-<k>"]


def make_policy(name: str, profile: PrefillLatencyModel, *,
                sp_candidates: Sequence[int] | None = None,
                min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS,
                chunk_align: int = DEFAULT_CHUNK_ALIGN,
                improvement_rate: float = 0.3) -> Policy:
    """A policy by name: tetris, tetris-single-chunk, loongserve-disagg or fixed-sp-<k>."""
    if name == "tetris":
        return CdspPolicy(name, profile, chunked=True, sp_candidates=sp_candidates,
                          min_chunk_tokens=min_chunk_tokens, chunk_align=chunk_align,
                          improvement_rate=improvement_rate)
    if name == "tetris-single-chunk":
        return CdspPolicy(name, profile, chunked=False, sp_candidates=sp_candidates,
                          improvement_rate=improvement_rate)
    if name == "loongserve-disagg":
        # LoongServe's ESP minimises each request's own prefill TTFT: θ fixed at 0.
        return CdspPolicy(name, profile, chunked=False, sp_candidates=sp_candidates,
                          improvement_rate=0.0, fixed_improvement_rate=True)
    if name.startswith("fixed-sp-"):
        k = name.removeprefix("fixed-sp-")
        if not k.isdigit() or int(k) <= 0:
            raise PolicyError(f"{name}: expected fixed-sp-<k> with a positive integer k")
        return FixedSpPolicy(int(k), profile)
    raise PolicyError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")


def policy_from_config(cfg: "SchedulerConfig", default_profile: str = "a100-llama3-8b-tp1", *,
                       profile: PrefillLatencyModel | None = None) -> Policy:
    """The policy a deployment's ``[scheduler]`` table describes; ``profile`` overrides the
    table's latency profile (e.g. one replaced at run time)."""
    from tetris.scheduler.latency import load_profile

    if profile is None:
        profile = load_profile(cfg.profile or default_profile)
    return make_policy(cfg.policy, profile, sp_candidates=cfg.sp_candidates or None,
                       min_chunk_tokens=cfg.min_chunk_tokens,
                       improvement_rate=cfg.improvement_rate)
