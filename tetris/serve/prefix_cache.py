"""Prefix caching in the served system: what the dispatcher does around the control plane's
``PrefixIndex`` (docs/prefix_cache.md).

1. ``make_index(config)``: the index when ``[prefix_cache] enabled``, else None (the dispatcher
   then plans and frees exactly as without this module);
2. ``block_hashes``: a run's prompt hashes go with its plan (``ControlPlane.plan``);
3. ``index_run`` after a successful prefill: the run's blocks are indexed where its KV lies,
   and the runs the index lets go are released on the prefill pool;
4. ``retained``: an indexed run's prefill KV is the cache's: it is not released when the KV
   reached decode, nor aborted with the run; the index releases it (3, or ``clear``);
5. ``told``: the client's first output carries the run's cached prompt tokens
   (``usage.prompt_tokens_details.cached_tokens``);
6. ``forget_missing``: a run whose cached prefix was gone on the pool (``PrefixMissing``, a
   ``PlanOutdated``: run again, not charged as a retry) makes the index forget its source.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tetris.config import PrefixCacheConfig
from tetris.control import ControlPlane
from tetris.control.prefix_index import PrefixIndex
from tetris.errors import PrefixMissing

__all__ = ["block_hashes", "clear", "forget_missing", "index_run", "make_index", "retained",
           "told", "view"]


def make_index(config: PrefixCacheConfig) -> PrefixIndex | None:
    return PrefixIndex(config.block_tokens, config.capacity_blocks) if config.enabled else None


def block_hashes(control: ControlPlane, prompt: Sequence[int] | None) -> dict:
    """``plan``'s keyword for the prompt's hashes (none without an index)."""
    index = control.prefix_index
    if index is None or prompt is None:
        return {}
    return {"block_hashes": index.hashes(list(prompt))}


async def index_run(control: ControlPlane, prefill, run_id: str) -> None:
    """The run's prefill succeeded: index it; release what the index let go."""
    if control.prefix_index is None:
        return
    control.prefix_cached(run_id)
    await release(control.prefix_released(), prefill)


async def release(runs: list[str], prefill) -> None:
    for run in runs:
        await prefill.release(run)


def told(out, cached_tokens: int):
    """``out`` carrying the run's cached prompt tokens if not told yet; (out, still to tell)."""
    if not cached_tokens:
        return out, 0
    return msgspec.structs.replace(out, cached_tokens=cached_tokens), 0


def forget_missing(control: ControlPlane, error: BaseException) -> None:
    """A run found its cached prefix gone (``PrefixMissing``): the index forgets that source,
    so the run's next plan, and every later one, computes the prefix again."""
    if isinstance(error, PrefixMissing) and control.prefix_index is not None and error.source:
        control.prefix_index.forget(error.source)


def retained(control: ControlPlane, run_id: str) -> bool:
    """The run's prefill KV belongs to the cache now."""
    index = control.prefix_index
    return index is not None and index.holds(run_id)


async def clear(control: ControlPlane, prefill) -> dict:
    """Drop every unreferenced block and free the runs let go; the index's stats after."""
    if control.prefix_index is not None:
        await release(control.prefix_index.clear(), prefill)
    return view(control)


def view(control: ControlPlane) -> dict:
    """``/admin/prefix_cache``: whether it is on, the index's counts, the runs whose KV it
    keeps (``source_runs``: with nothing in flight, exactly the runs the prefill pool holds)
    and whether its bookkeeping holds (``consistent``: ``PrefixIndex.check``, every block
    referenced or free)."""
    index = control.prefix_index
    if index is None:
        return {"enabled": False}
    try:
        index.check()
        consistent = True
    except AssertionError as e:
        consistent = str(e)
    return {"enabled": True, "block_tokens": index.block_tokens, **index.stats(),
            "source_runs": index.sources(), "consistent": consistent}
