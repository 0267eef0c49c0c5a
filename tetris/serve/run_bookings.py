"""What a run of a request books and frees, mixed into the dispatcher.

A run books a decode instance and its KV tokens there (the control plane's virtual usage)
and reserves its blocks (step 1 of the lifecycle in ``tetris/serve/dispatcher.py``); after a
lost instance it is routed again (step 6). When the KV has arrived the prefill copy and the
virtual usage go (step 5); at the end, or when a run is lost, whatever it still holds is freed
on both sides, exactly once.
"""

from __future__ import annotations

import asyncio
import logging

from tetris.scheduler.router import NoInstanceUp
from tetris.serve import prefix_cache
from tetris.serve.backend import Overloaded
from tetris.serve.protocol import GenerateRequest
from tetris.serve.timeline import ClientProgress, RequestTimeline, attempt_id

__all__ = ["COMPLETED", "RunBookings"]

log = logging.getLogger("tetris.serve.dispatcher")   # the dispatcher's log, as before the split

COMPLETED = ("stop", "length")   # finish reasons after which nothing is left to abort


class RunBookings:
    """Mixed into ``Dispatcher``: routes a run's decode side, books it and frees what it holds."""

    def _route(self, req: GenerateRequest, aid: str, tl: RequestTimeline,
               avoid: frozenset[int] = frozenset()) -> int:
        """The run's decode instance (control plane); its blocks are reserved by the caller."""
        kv_tokens = len(req.prompt_token_ids) + req.sampling.max_tokens
        try:
            instance = self.control.route(aid, kv_tokens, avoid)
        except NoInstanceUp as e:
            raise Overloaded(f"{e}: restarting, retry shortly", retry_after_s=2.0) from None
        tl.decode_instance = instance
        return instance

    def _route_reserve(self, req: GenerateRequest, aid: str, tl: RequestTimeline):
        """A first run's decode instance (its master when ``[decode] elastic`` places it over
        a group) and the call reserving its blocks there (tetris/serve/elastic_dispatch.py)."""
        if self.elastic is None:
            instance = self._route(req, aid, tl)
            return instance, self.decode.reserve(instance, aid, req.prompt_token_ids,
                                                 req.sampling, **prefix_cache.keep_kw(self))
        group = self.elastic.route(aid, len(req.prompt_token_ids), req.sampling.max_tokens)
        tl.decode_instance = group.master
        if (ranges := self.elastic.ranges(aid)) is not None:
            return group.master, self.decode.elastic_place(aid, req.prompt_token_ids,
                                                           req.sampling, ranges)
        return group.master, self.decode.reserve(group.master, aid, req.prompt_token_ids,
                                                 req.sampling, **prefix_cache.keep_kw(self))

    async def _reroute(self, req: GenerateRequest, aid: str, tl: RequestTimeline,
                       sent: ClientProgress) -> int:
        """Route a run after a lost instance: another decode instance if one is up, else the
        lost one once it is back (restarted by its healer); ``retry_wait_s`` at most."""
        avoid = frozenset() if sent.lost_decode is None else frozenset({sent.lost_decode})
        deadline = self.clock() + self.retry_wait_s
        while True:
            try:
                if self.elastic is not None:   # whole or over a decode group
                    tl.decode_instance = await self.elastic.reserve_again(
                        self.decode, req, aid, avoid, tuple(sent.token_ids))
                    return tl.decode_instance
                instance = self._route(req, aid, tl, avoid)
                await self.decode.reserve(instance, aid, req.prompt_token_ids, req.sampling,
                                          tuple(sent.token_ids))
                return instance
            except Overloaded as e:
                self.control.kv_arrived(aid)   # give the virtual usage back before trying again
                if self.elastic is not None:   # and the placer's, and any range held already
                    await self.elastic.free(self.decode, aid, completed=False)
                if self.clock() >= deadline:
                    raise RuntimeError(f"request {req.request_id}: no decode instance took it back "
                                       f"within {self.retry_wait_s:g} s of losing its own: {e}") from None
                await asyncio.sleep(self.retry_poll_s)

    async def _kv_arrived(self, aid: str, tl: RequestTimeline) -> None:
        """The decode instance has all the KV (its first output): drop the prefill copy and the
        virtual usage."""
        tl.first_output = tl.first_output or self.clock()
        self.control.kv_arrived(aid)
        if self.elastic is not None:
            self.elastic.arrived(aid)
        if not prefix_cache.retained(self.control, aid):   # else the cache's, until let go
            await self.prefill.release(aid)

    async def _cleanup(self, rid: str, tl: RequestTimeline, drops=()) -> None:
        """Free everything the request still holds (and the decode KV the prefix cache let
        go for it: ``drops``); every step is idempotent."""
        tl.finished = self.clock()
        self._inflight.pop(rid, None)
        await self._free(attempt_id(rid, tl.retries), tl.decode_instance,
                         completed=tl.outcome in COMPLETED)
        await prefix_cache.drop_kept(self.decode, drops)
        self.timelines.append(tl)

    async def _free(self, aid: str, decode_instance: int, *, completed: bool) -> None:
        """Free what one run of a request holds: bookings, virtual usage and, unless it
        completed, its state on both pools (a lost instance's answers are logged, not raised)."""
        self.control.finished(aid, self.clock())
        self._relay.close(aid)
        if self.elastic is not None:   # the placer's usage and a group's ranges on every member
            try:
                await self.elastic.free(self.decode, aid, completed=completed)
            except Exception as e:  # noqa: BLE001 - cleanup must reach every side
                log.warning("cleanup of %s's decode group: %s", aid, e)
        if completed:
            return
        try:
            if not prefix_cache.retained(self.control, aid):   # a cached prefill stays
                await self.prefill.abort(aid)
        except Exception as e:  # noqa: BLE001 - cleanup must reach every side
            log.warning("cleanup of %s on the prefill pool: %s", aid, e)
        if decode_instance >= 0:
            try:
                await self.decode.abort(decode_instance, aid)
            except Exception as e:  # noqa: BLE001
                log.warning("cleanup of %s on decode instance %d: %s", aid, decode_instance, e)
