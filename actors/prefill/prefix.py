"""Prefix caching on the prefill pool: a plan that starts from a cached prefix (``PrefillPlan.
cached_tokens``) runs only its chunks; the prefix is history its source run left on the plan's
``cached_instances``.

1. Before the first chunk, every holder copies the source run's KV below ``cached_tokens`` that
   it holds under the new run's id (``PagedKVStore.copy_prefix``), so that the source may be
   freed (the control plane's index decides when) while the new run goes on.
2. The copies together must be exactly ``[0, cached_tokens)``; they are the layout's history
   before chunk 0 (``plan_layout(..., cached)``), and cache balancing spreads them to the
   members chunk 0 adds, as between chunks.
3. A failure from here on frees the copies with the rest of the run (the pool's abort path).

Not built: streaming a cached prefix's KV to a decode instance (only KV computed in a chunk is
streamed), so a run with ``kv_receivers`` and a cached prefix is refused.
"""

from __future__ import annotations

from tetris.actors.prefill.messages import PrefillError
from tetris.actors.prefill.zigzag import Ranges, normalize_ranges, ranges_len

from tetris.plan import PlanError, PrefillPlan

__all__ = ["adopt_prefix"]


def adopt_prefix(pool, plan: PrefillPlan, opts) -> dict[int, Ranges]:
    """Copy the cached prefix on its holders to ``plan``'s run; instance -> positions."""
    if opts.kv_receivers:
        raise PlanError(f"plan {plan.request_id}: streaming a cached prefix's KV to decode is "
                        "not built; plan it without the cache")
    holders = plan.cached_instances
    workers = pool.workers
    got = pool._on_workers(
        [workers[i] for i in holders],
        lambda w: w.adopt_prefix.remote(plan.cached_source, plan.request_id, plan.cached_tokens))
    held = {i: tuple(tuple(r) for r in (ranges or ())) for i, ranges in zip(holders, got)}
    parts = [r for ranges in held.values() for r in ranges]
    whole = ((0, plan.cached_tokens),)
    try:
        ok = normalize_ranges(parts) == whole and ranges_len(parts) == plan.cached_tokens
    except ValueError:   # overlapping copies
        ok = False
    if not ok:
        raise PrefillError(f"request {plan.request_id}: the cached prefix [0, "
                           f"{plan.cached_tokens}) of {plan.cached_source!r} is not whole on "
                           f"prefill instances {holders} (they hold {held})")
    return held
