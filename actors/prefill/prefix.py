"""Prefix caching on the prefill pool: a plan that starts from a cached prefix (``PrefillPlan.
cached_tokens``) runs only its chunks; the prefix is history its source run left on the plan's
``cached_instances``.

1. When the first chunk's turn has come (the source run, committed earlier, may have been
   running on the holders until then), every holder copies the source run's KV below
   ``cached_tokens`` that it holds under the new run's id (``PagedKVStore.copy_prefix``), so
   that the source may be freed (the control plane's index decides when) while the new run
   goes on.
2. The copies together must be exactly ``[0, cached_tokens)`` (else ``PrefillPrefixMissing``:
   the dispatcher forgets the source and plans again); they are the layout's history
   before chunk 0 (``plan_layout(..., cached)``), and cache balancing spreads them to the
   members chunk 0 adds, as between chunks.
3. With ``kv_receivers``, every holder streams its copy to each decode rank (its head slice)
   as one shard of the pseudo-chunk ``PREFIX_CHUNK`` covering ``[0, cached_tokens)``
   (``stream_prefix``): the chunks stream only the KV they compute, and a decode rank admits
   the request once every position of every layer arrived, whichever chunk carried it.
4. A failure from here on frees the copies (and cancels their shards) with the rest of the
   run (the pool's abort path).
"""

from __future__ import annotations

import time

import torch
from tetris.actors.prefill.messages import PrefillError
from tetris.actors.prefill.zigzag import Ranges, normalize_ranges, ranges_len

from tetris.errors import PrefixMissing
from tetris.plan import PrefillPlan

__all__ = ["PREFIX_CHUNK", "PrefillPrefixMissing", "adopt_prefix", "stream_prefix"]


class PrefillPrefixMissing(PrefillError, PrefixMissing):
    """The cached prefix a plan reads is not whole on its holders: the dispatcher forgets the
    source and plans the request again (``PrefixMissing``)."""

    def __init__(self, message: str, source: str = "") -> None:
        PrefixMissing.__init__(self, message, source)

# The chunk index of a cached prefix's shards: before every chunk of the plan (0, 1, ...).
PREFIX_CHUNK = -1


def adopt_prefix(pool, plan: PrefillPlan, opts) -> dict[int, Ranges]:
    """Copy the cached prefix on its holders to ``plan``'s run (streaming it to
    ``opts.kv_receivers``); instance -> positions."""
    holders = plan.cached_instances
    workers = pool.workers
    got = pool._on_workers(
        [workers[i] for i in holders],
        lambda w: w.adopt_prefix.remote(plan.cached_source, plan.request_id, plan.cached_tokens,
                                        plan.prompt_tokens,
                                        tuple(opts.kv_receivers) if opts.prefix_streamed else ()))
    held = {i: tuple(tuple(r) for r in (ranges or ())) for i, ranges in zip(holders, got)}
    parts = [r for ranges in held.values() for r in ranges]
    whole = ((0, plan.cached_tokens),)
    try:
        ok = normalize_ranges(parts) == whole and ranges_len(parts) == plan.cached_tokens
    except ValueError:   # overlapping copies
        ok = False
    if not ok:
        raise PrefillPrefixMissing(
            f"request {plan.request_id}: the cached prefix [0, {plan.cached_tokens}) of "
            f"{plan.cached_source!r} is not whole on prefill instances {holders} (they hold "
            f"{held})", plan.cached_source)
    return held


def stream_prefix(mgr, store, request_id: str, ranges: Ranges, prompt_tokens: int, upto: int,
                  receivers: tuple[int, ...]) -> None:
    """Hand ``request_id``'s KV at ``ranges`` (held in ``store``) to the send manager ``mgr``:
    one shard per receiver, its slice of the KV heads (as the chunks split them), all layers
    ready at once. Call with the pump's lock held."""
    hkv = store.k_cache[0].shape[2]
    if hkv % len(receivers) or len(set(receivers)) != len(receivers):
        raise ValueError(f"{hkv} KV heads cannot be split over receivers {receivers}")
    h = hkv // len(receivers)
    now = time.monotonic()
    for r in receivers:
        mgr.add_shard(request_id=request_id, chunk_index=PREFIX_CHUNK, receiver_id=r,
                      prompt_tokens=prompt_tokens, chunk=(0, upto), ranges=ranges,
                      num_layers=store.num_layers, kv_heads=h,
                      head_dim=store.k_cache[0].shape[3], dtype=store.k_cache[0].dtype, now=now)
    for layer in range(store.num_layers):
        k, v = store.read(request_id, layer, ranges)   # [n, Hkv, D] each
        for j, r in enumerate(receivers):
            kv = torch.stack((k[:, j * h:(j + 1) * h], v[:, j * h:(j + 1) * h]), dim=1)
            mgr.layer_ready(request_id, PREFIX_CHUNK, layer, kv, receiver_id=r)
