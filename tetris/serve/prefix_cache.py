"""Prefix caching in the served system: what the dispatcher does around the control plane's
``PrefixIndex`` (docs/prefix_cache.md).

1. ``make_index(config)``: the index when ``[prefix_cache] enabled``, else None (the dispatcher
   then plans and frees exactly as without this module); ``make_move`` the link model of a
   hit's "move" placement (``[prefix_cache] placement``);
2. ``block_hashes``: a run's prompt hashes go with its plan (``ControlPlane.plan``);
3. ``index_run`` after a successful prefill: the run's blocks are indexed where its KV lies,
   and the runs the index lets go are released on the prefill pool;
4. ``retained``: an indexed run's prefill KV is the cache's: it is not released when the KV
   reached decode, nor aborted with the run; the index releases it (3, or ``clear``);
5. ``told``: the client's first output carries the run's cached prompt tokens
   (``usage.prompt_tokens_details.cached_tokens``);
6. ``forget_missing``: a run whose cached prefix was gone on the pool (``PrefixMissing``, a
   ``PlanOutdated``: run again, not charged as a retry) makes the index forget its source;
7. the decode side (``[prefix_cache] decode_runs`` > 0, ``tetris.control.decode_kept``): every
   run's decode KV is kept when it completes (``keep_kw``, ``finished_run``; at most
   ``decode_runs`` runs an instance, the least recently used freed); a request sharing leading
   blocks with a kept run is routed to its instance, and when the run holds the prefix the
   plan reads from the prefill pool's cache, the instance copies it from the run and the pool
   does not stream it (``route_to_kept``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tetris.config import PrefixCacheConfig
from tetris.control import ControlPlane
from tetris.control.decode_kept import DecodeKept
from tetris.control.prefix_index import PrefixIndex
from tetris.errors import PrefixMissing
from tetris.scheduler.prefix_move import PrefixMove
from tetris.serve.remote_errors import carried

__all__ = ["block_hashes", "clear", "drop_kept", "finished_run", "forget_missing", "index_run",
           "keep_kw", "make_decode_kept", "make_index", "make_move", "retained", "route_to_kept",
           "told", "view"]


def make_index(config: PrefixCacheConfig) -> PrefixIndex | None:
    return PrefixIndex(config.block_tokens, config.capacity_blocks) if config.enabled else None


def make_move(deployment) -> PrefixMove | None:
    """The link model a hit's "move" placement is priced on (``tetris.scheduler.prefix_move``):
    the deployment's model per prefill TP rank and its ``[sp_layout]`` links per GPU (on TP > 1
    instances every rank moves its own KV heads over its own links, at once:
    ``actors/prefill/prefix_move.py``)."""
    return PrefixMove.from_deployment(deployment)


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


async def clear(control: ControlPlane, prefill, decode=None,
                decode_kept: DecodeKept | None = None) -> dict:
    """Drop every unreferenced block and free the runs let go, and every run's KV kept on
    decode; the index's stats after."""
    if control.prefix_index is not None:
        await release(control.prefix_index.clear(), prefill)
    if decode_kept is not None:
        await drop_kept(decode, decode_kept.clear())
    return view(control, decode_kept)


# -- the decode side -------------------------------------------------------------------------
def make_decode_kept(config: PrefixCacheConfig) -> DecodeKept | None:
    if not (config.enabled and config.decode_runs):
        return None
    return DecodeKept(config.block_tokens, config.decode_runs)


def keep_kw(dispatcher) -> dict:
    """``reserve``'s keyword: keep the run's decode KV once it completes."""
    return {"keep": True} if getattr(dispatcher, "decode_kept", None) is not None else {}


async def route_to_kept(d, req, aid: str, tl):
    """Route, plan and reserve a first run whose prompt shares leading blocks with a run kept
    on a decode instance that is up: (instance, plan, ``prefill.run``'s keywords), or None
    (route as usual). The instance copies the kept prefix when that run holds all of the
    plan's cached tokens; the pool then does not stream them."""
    kept = getattr(d, "decode_kept", None)
    if kept is None:
        return None
    prompt = req.prompt_token_ids
    hashes = d.control.prefix_index.hashes(list(prompt))
    instances = frozenset(range(d.control.router.num_instances))
    best = kept.best(hashes, instances - frozenset(d.control.router.down))
    if best is None:
        return None
    # avoid every other instance: the router takes the holder while it is up
    instance = d._route(req, aid, tl, instances - {best[0]})
    plan = await d._plan(aid, len(prompt), tl, prompt)
    run = kept.covering(instance, hashes, plan.cached_tokens) if plan.cached_tokens else None
    if run is not None:
        try:
            await d.decode.reserve(instance, aid, prompt, req.sampling, keep=True,
                                   prefix_from=run, prefix_tokens=plan.cached_tokens)
            kept.reused(plan.cached_tokens)
            # The kept run's whole blocks below the prefix are shared, counted as used by the
            # instance already (the boundary block is copied): book only the rest.
            block = d.deployment.decode.block_size
            d.control.book_shared(aid, plan.cached_tokens // block * block)
            return instance, plan, {"prefix_streamed": False}
        except Exception as e:
            if carried(e, ValueError) is None:
                raise
            # the instance freed that run to make room (KeptKV.make_room): stream the prefix
            kept.remove(instance, run)
    await d.decode.reserve(instance, aid, prompt, req.sampling, keep=True)
    return instance, plan, {}


def finished_run(d, req, aid: str, tl, output_ids, completed: bool) -> list[tuple[int, str]]:
    """A request is over: a first run that completed is kept on its decode instance (its KV
    covers the prompt and the output but its last token); the runs let go for it."""
    kept = getattr(d, "decode_kept", None)
    if kept is None or not completed or tl.retries or tl.decode_instance < 0:
        return []
    tokens = [int(t) for t in req.prompt_token_ids] + [int(t) for t in output_ids]
    hashes = d.control.prefix_index.hashes(tokens[:-1])
    return [(tl.decode_instance, r) for r in kept.add(tl.decode_instance, aid, hashes)]


async def drop_kept(decode, runs: list[tuple[int, str]]) -> None:
    for instance, run in runs:
        await decode.drop_kept(instance, run)


def view(control: ControlPlane, decode_kept: DecodeKept | None = None) -> dict:
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
    kept = {} if decode_kept is None else {**decode_kept.stats(),
                                           "decode_kept": decode_kept.runs()}
    return {"enabled": True, "block_tokens": index.block_tokens, **index.stats(),
            "source_runs": index.sources(), "consistent": consistent, **kept}
