"""Prefix caching's third placement (issue #23 item 2): a cached prefix's KV moved from its
holders H to the first chunk's group G, which need not contain them (``PrefillPlan.cached_moved``).

1. At chunk 0's turn (G's), the driver waits until the source run has no chunk left on H: it
   was committed earlier and may still run there (G's turn says nothing about H).
2. G's shares: ``[0, cached_tokens)`` cut in ring order into the even counts cache balancing
   gives a group that holds nothing yet (``balance.even_targets``; one-token extras to the
   first members), one contiguous range per member (``move_shares``).
3. Every holder exports (``export_parts``, in its transfer concurrency group: beside whatever
   chunk its default thread runs, never waiting for it) the positions below ``cached_tokens`` it
   holds, and per member of G the KV of those inside that member's share: ``1 + |G|`` Ray
   returns, read under the store's lock (``PagedKVStore.export_below``). Export is read-only:
   the holders copy nothing under the new run's id.
4. The holders' positions must be exactly ``[0, cached_tokens)`` (else ``PrefillPrefixMissing``,
   as ``adopt_prefix``); a dead holder holds nothing.
5. Every member of G imports its share (``import_parts``, default group: reserve, write every
   layer, stream to the decode ranks as ``stream_prefix`` does), its parts passed as the
   holders' ObjectRefs, so the KV goes from holder to member through the object store, never
   through the driver.
6. The shares are chunk 0's history (``layout.plan_layout``: no balancing before chunk 0). A
   failure from step 3 on frees what G imported through the pool's abort path (a dead member of
   G is replaced, as after a chunk); H held nothing of the run, so nothing leaks.

TP > 1: every TP rank of a holder exports its heads (``merge_rank_parts`` concatenates them in
rank order) and every TP rank of a member of G keeps its own slice and streams it to its own
decode receivers, as ``adopt_prefix`` and the chunks do. EMULATION (emulated workers):
positions only; the parts carry no KV and the streamed prefix is zero KV of the wire geometry
(``EmulatedExecutor.stream_prefix``).
"""

from __future__ import annotations

import ray
import torch
from tetris.actors.prefill.balance import even_targets
from tetris.actors.prefill.chunks import ChunkFailed
from tetris.actors.prefill.emulated_kv import subtract_ranges
from tetris.actors.prefill.messages import PrefillError, PrefillWorkerLost, first_line
from tetris.actors.prefill.prefix import PREFIX_CHUNK, PrefillPrefixMissing, stream_prefix
from tetris.actors.prefill.tp_groups import own_receivers
from tetris.actors.prefill.zigzag import Ranges, normalize_ranges, ranges_len, ranges_to_list

from tetris.plan import PrefillPlan

__all__ = ["export_parts", "import_parts", "merge_rank_parts", "move_prefix", "move_shares",
           "positions_ranges"]

# (positions as ranges, k [L, n, Hkv, D] | None, v | None): one holder's KV for one member
Part = tuple


def move_shares(cached_tokens: int, group_size: int) -> tuple[Ranges, ...]:
    """Per member of G in ring order, its contiguous share of ``[0, cached_tokens)``: the even
    counts of cache balancing (``even_targets`` of a group holding nothing: extras first)."""
    counts = even_targets([0] * group_size, cached_tokens)
    shares, lo = [], 0
    for n in counts:
        shares.append(((lo, lo + n),) if n else ())
        lo += n
    return tuple(shares)


def positions_ranges(pos: list[int]) -> Ranges:
    """Sorted distinct positions -> ranges."""
    out: list[tuple[int, int]] = []
    for p in pos:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return tuple(out)


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return subtract_ranges(a, subtract_ranges(a, b))


# -- the worker side ------------------------------------------------------------------------
def export_parts(worker, source: str, upto: int, shares: tuple[Ranges, ...]) -> tuple:
    """A holder's answer to ``export_prefix``: ``(held, part_0, ..., part_{|G|-1})``, where
    ``held`` is ``source``'s positions below ``upto`` held here and ``part_r`` its KV inside
    ``shares[r]``. Reads only."""
    if worker.store is None:   # EMULATION: positions only
        held = tuple((lo, min(hi, upto)) for lo, hi in worker.executor.holdings.ranges(source)
                     if lo < upto)
        return (held, *((_intersect(held, s), None, None) for s in shares))
    pos, k, v = worker.store.export_below(source, upto)   # [n], [L, n, Hkv, D] x 2
    held = positions_ranges(pos.tolist())
    parts = []
    for share in shares:
        mine = torch.zeros_like(pos, dtype=torch.bool)
        for lo, hi in share:
            mine |= (pos >= lo) & (pos < hi)
        parts.append((positions_ranges(pos[mine].tolist()), k[:, mine].contiguous(),
                      v[:, mine].contiguous()))
    return (held, *parts)


def merge_rank_parts(answers: list[tuple]) -> tuple:
    """One ``export_parts`` answer per TP rank of an instance, in rank order -> the
    instance's: the same positions, K/V heads concatenated in rank order."""
    held = answers[0][0]
    if any(a[0] != held for a in answers[1:]):
        raise RuntimeError("the TP ranks of a prefill instance hold different positions")
    parts = []
    for r in range(1, len(answers[0])):
        ranks = [a[r] for a in answers]
        if ranks[0][1] is None:   # EMULATION: positions only
            parts.append(ranks[0])
            continue
        parts.append((ranks[0][0], torch.cat([p[1] for p in ranks], dim=2),
                      torch.cat([p[2] for p in ranks], dim=2)))
    return (held, *parts)


def import_parts(worker, request_id: str, share: Ranges, prompt_tokens: int, upto: int,
                 receivers: tuple[int, ...], parts: tuple[Part, ...]) -> Ranges:
    """A member of G takes its share of the moved prefix from the holders' ``parts``: stores
    it under ``request_id`` and streams it to ``receivers``; returns the share."""
    got = [r for part in parts for r in part[0]]
    if normalize_ranges(got) != normalize_ranges(share) or ranges_len(got) != ranges_len(share):
        raise ValueError(f"request {request_id}: the moved prefix's parts {got} are not the "
                         f"share {share} of prefill instance {worker.instance}")
    if not share:
        return ()
    if receivers:
        worker._streaming()   # before anything is reserved: transfer must be enabled
    if worker.store is None:   # EMULATION: positions only, zero KV streamed
        worker.executor.holdings.reserve(request_id, share)
        if receivers:
            worker.executor.stream_prefix(request_id, share, prompt_tokens, upto, receivers)
        return share
    store = worker.store
    pos = torch.tensor([p for part in parts for p in ranges_to_list(part[0])], dtype=torch.int64)
    order = torch.argsort(pos)   # the parts' positions, each part in order, into share order
    # [L, n, Hkv, D]: the instance's heads; a TP rank keeps its slice, as the chunks split them
    h = store.k_cache[0].shape[2]
    heads = slice(worker.tp_rank * h, (worker.tp_rank + 1) * h)
    k = torch.cat([part[1] for part in parts], dim=1)[:, order][:, :, heads]
    v = torch.cat([part[2] for part in parts], dim=1)[:, order][:, :, heads]
    if worker.tp_size > 1 and receivers:
        receivers = own_receivers(receivers, worker.tp_rank, worker.tp_size)
    store.reserve(request_id, share)
    for layer in range(store.num_layers):
        _maybe_fail(worker.executor, request_id, layer)
        store.write(request_id, layer, share, k[layer].to(store.k_cache[0].device),
                    v[layer].to(store.v_cache[0].device))
    if receivers:
        with worker._streaming().pump.locked() as mgr:
            stream_prefix(mgr, store, request_id, share, prompt_tokens, upto, receivers)
    return share


def _maybe_fail(executor, request_id: str, layer: int) -> None:
    """Test hook (``set_fault(request_id, PREFIX_CHUNK, layer)``): fail once at ``layer``."""
    if executor.fault == (request_id, PREFIX_CHUNK, layer):
        from tetris.actors.prefill.executor import FaultInjected

        executor.fault = None
        raise FaultInjected(f"injected fault importing a moved prefix at layer {layer}")


# -- the driver side ------------------------------------------------------------------------
def move_prefix(pool, plan: PrefillPlan, opts) -> dict[int, Ranges]:
    """Move ``plan``'s cached prefix from its holders to chunk 0's group (streaming it to
    ``opts.kv_receivers``); instance of G -> its share. Call at chunk 0's turn."""
    holders, group = plan.cached_instances, plan.chunks[0].instances
    pool._tickets.wait_gone(plan.cached_source, holders, pool.chunk_timeout_s)
    shares = move_shares(plan.cached_tokens, len(group))
    workers = pool.workers
    exports = [workers[h].export_prefix.options(num_returns=1 + len(group)).remote(
        plan.cached_source, plan.cached_tokens, shares) for h in holders]
    held = {}
    for h, refs in zip(holders, exports):
        try:
            held[h] = ray.get(refs[0], timeout=pool.chunk_timeout_s)
        except ray.exceptions.RayActorError:
            held[h] = ()   # a dead holder holds nothing any more
        except Exception as e:  # noqa: BLE001 - the caller gets a PrefillError
            raise PrefillError(f"request {plan.request_id}: prefill instance {h} could not "
                               f"export the cached prefix of {plan.cached_source!r}: "
                               f"{type(e).__name__}: {first_line(e)}") from None
    _check_whole(plan, held)
    receivers = tuple(opts.kv_receivers) if opts.prefix_streamed else ()
    imports = [workers[g].import_prefix.remote(
        plan.request_id, shares[r], plan.prompt_tokens, plan.cached_tokens, receivers,
        *[refs[1 + r] for refs in exports]) for r, g in enumerate(group)]
    _await_imports(pool, plan, group, imports)
    return dict(zip(group, shares))


def _check_whole(plan: PrefillPlan, held: dict[int, Ranges]) -> None:
    parts = [r for ranges in held.values() for r in ranges]
    try:
        ok = normalize_ranges(parts) == ((0, plan.cached_tokens),) and \
            ranges_len(parts) == plan.cached_tokens
    except ValueError:   # overlapping holdings
        ok = False
    if not ok:
        raise PrefillPrefixMissing(
            f"request {plan.request_id}: the cached prefix [0, {plan.cached_tokens}) of "
            f"{plan.cached_source!r} is not whole on prefill instances {plan.cached_instances} "
            f"(they hold {held}); nothing was moved", plan.cached_source)


def _await_imports(pool, plan: PrefillPlan, group, imports) -> None:
    """Wait for every member's import; a failure is a ``ChunkFailed`` (the pool frees G, and
    replaces a member of G found dead, as after a chunk's prepare). An import fails too when
    its holder's export did (a dead holder's error reads like a dead member's): members are
    probed, and a dead holder makes the prefix missing (the dispatcher plans again)."""
    errors = []
    for g, ref in zip(group, imports):
        try:
            ray.get(ref, timeout=pool.chunk_timeout_s)
        except Exception as e:  # noqa: BLE001 - every failure becomes a PrefillError
            errors.append((g, getattr(e, "cause", None) or e))
    if not errors:
        return
    workers = pool.workers
    dead = [i for i in sorted(set(group) | set(plan.cached_instances)) if not _alive(workers[i])]
    lost = [(g, e) for g, e in errors if g in dead]
    g, err = (lost or errors)[0]
    if lost:
        error: PrefillError = PrefillWorkerLost(
            f"request {plan.request_id}: prefill instance {g} died while the cached prefix of "
            f"{plan.cached_source!r} was moved to it: {type(err).__name__}: {first_line(err)}")
    elif any(h in dead for h in plan.cached_instances):
        error = PrefillPrefixMissing(
            f"request {plan.request_id}: a holder of the cached prefix of "
            f"{plan.cached_source!r} died while it was moved (dead: {dead})", plan.cached_source)
    else:
        error = PrefillError(
            f"request {plan.request_id}: moving the cached prefix of {plan.cached_source!r} to "
            f"prefill instance {g} failed: {type(err).__name__}: {first_line(err)}")
    # only members found dead count as lost (``PrefillPool._recover`` replaces those)
    errors = [(i, e if i in dead else PrefillError(str(e))) for i, e in errors]
    raise ChunkFailed("import_prefix", 1, errors, {i: workers[i] for i in group}, error)


def _alive(worker) -> bool:
    try:
        ray.get(worker.alive.remote(), timeout=30.0)
    except ray.exceptions.RayActorError:
        return False
    except Exception:  # noqa: BLE001 - a slow or failing probe: not found dead
        return True
    return True
