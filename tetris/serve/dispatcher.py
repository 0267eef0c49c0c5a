"""The dispatcher: plans each request's prefill, routes its decode and drives both to the end.

It is the async driver of the control plane (``tetris.control.ControlPlane``: the policy,
θ, the prefill queue and the decode router, every decision about a request), which the
simulator drives with the same calls in the same order. Around it the dispatcher does what
takes time: the hops to the two pools, retries and the output stream. Beyond ``max_pending``
requests in flight it refuses with ``Overloaded``.

Lifecycle of one request (``generate``), on the dispatcher's monotonic clock:

1. route (control plane): choose a decode instance and book the request's KV tokens there
   (virtual usage); reserving its KV blocks on the instance (``decode.reserve``) runs while
   the plan is made; no room -> ``Overloaded``;
2. plan under the planning lock (so plans commit in the order they were made), register the
   plan with the pool (``prefill.commit``) and book it in the control plane's queue. A plan
   the pool refuses (``InstanceReplacing``: a worker found dead since its last report) is
   made again around the instance on a fresh report, before anything ran;
3. run the plan (``prefill.run``): chunks stream their KV layer by layer to the decode
   instance's TP ranks; the result carries the first token, which this generator yields at
   once (``first_token``: TTFT ends with the prefill, the KV hand-off is not in it);
4. the prefill member that sampled the first token sent it to the decode ranks with the KV
   (``PrefillResult.first_token_streamed``; else this hands it over with ``decode.commit``);
   the decode instance admits the request once every rank has the KV and the token, then
   streams tokens, which this generator yields (or, relayed, the ingress reads them);
5. at the first decode output the KV has arrived: the prefill side frees its copy and the
   router its virtual usage. On completion, abort, client disconnect or error, ``_cleanup``
   frees whatever is still held, on both sides, exactly once.
6. if a prefill worker or the decode instance dies under the request (``InstanceLost``), what
   that run holds is freed and the request runs again from 1 under a fresh id, avoiding the
   lost decode instance: its prefill covers the prompt plus the output tokens the client
   already has, the decode instance takes those as output already made, and the stream goes on
   where the client's stopped. Greedy and seeded requests resume exactly (a seeded draw is
   keyed by seed and position); an unseeded sampled one goes on with fresh random draws. A
   run lost to an outdated plan (``PlanOutdated``: committed before a member's worker was
   found dead, not yet started there) runs again without being charged against ``retries``.

The two sides are reached through ``PrefillClient`` and ``DecodeClient``
(``tetris.serve.clients``). Booking and freeing a run's decode side (steps 1, 5 and 6) is in
``tetris.serve.run_bookings``; the operator surface in ``tetris.serve.dispatcher_admin``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import msgspec

from tetris.config import DeploymentConfig
from tetris.control import ControlPlane, PrefillQueue
from tetris.engine.request import OutputDelta
from tetris.errors import InstanceLost, InstanceReplacing, PlanOutdated
from tetris.plan import PrefillPlan
from tetris.scheduler.latency import load_profile
from tetris.scheduler.rate import ImprovementRateTable
from tetris.scheduler.router import DecodeRouter
from tetris.serve import elastic_dispatch, prefix_cache
from tetris.serve.backend import Overloaded
from tetris.serve.clients import DecodeClient, PrefillClient
from tetris.serve.dispatcher_admin import DispatcherAdmin
from tetris.serve.first_token import EarlyFirstToken, StreamCursor
from tetris.serve.metrics import ServingMetrics
from tetris.serve.protocol import GenerateRequest
from tetris.serve.relay import DecodeHandoff, RelayBoxes, RelayReport
from tetris.serve.run_bookings import COMPLETED, RunBookings
from tetris.serve.timeline import ClientProgress, RequestTimeline, attempt_id
from tetris.token_ids import TokenIds, compact_tokens

__all__ = ["Dispatcher", "PrefillClient", "DecodeClient", "RequestTimeline", "DEFAULT_PROFILE"]

log = logging.getLogger(__name__)

DEFAULT_PROFILE = "a100-llama3-8b-tp1"
_PLAN_TRIES = 3                   # plans per run refused for instances being replaced, at most
_OUTDATED_RUNS = 4                # runs again for outdated plans, beyond ``retries``


class Dispatcher(RunBookings, DispatcherAdmin):
    def __init__(self, deployment: DeploymentConfig, prefill: PrefillClient, decode: DecodeClient,
                 *, node_of: Sequence[int], decode_capacities: Sequence[int],
                 metrics: ServingMetrics | None = None, max_pending: int = 256,
                 rate_table: ImprovementRateTable | None = None,
                 clock: Callable[[], float] = time.monotonic, keep_timelines: int = 1024,
                 first_token: EarlyFirstToken | None = None, retries: int = 2,
                 retry_wait_s: float = 60.0, retry_poll_s: float = 0.5,
                 relay: bool = False) -> None:
        if retries < 0 or retry_wait_s < 0 or retry_poll_s <= 0:
            raise ValueError(f"retries and retry_wait_s must be >= 0 and retry_poll_s > 0, got "
                             f"{retries}, {retry_wait_s}, {retry_poll_s}")
        self.retries = retries
        self.retry_wait_s = retry_wait_s
        self.retry_poll_s = retry_poll_s
        self.deployment = deployment
        self.first_token = first_token   # None: the first token comes with the decode stream
        # True: the caller streams the decode outputs itself (``tetris.serve.relay``)
        self.relay = relay
        self._relay = RelayBoxes()
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.max_pending = max_pending
        self.clock = clock
        sc = deployment.scheduler
        self.profile = load_profile(sc.profile or DEFAULT_PROFILE)
        self.control = ControlPlane(self._make_policy(self.profile), PrefillQueue(node_of),
                                    DecodeRouter(decode_capacities),
                                    improvement_rate=sc.improvement_rate,
                                    monitor=self._make_monitor(rate_table),
                                    prefix_index=prefix_cache.make_index(deployment.prefix_cache),
                                    prefix_placement=deployment.prefix_cache.placement,
                                    prefix_move=prefix_cache.make_move(deployment))
        self.decode_kept = prefix_cache.make_decode_kept(deployment.prefix_cache)
        # [decode] elastic: first runs placed by ElasticPlacer on the same router
        self.elastic = elastic_dispatch.make_routing(deployment, self.control.router,
                                                     decode_capacities)
        if metrics is not None:
            for i in range(self.control.router.num_instances):
                metrics.set_decode_up(i, True)
        self._plan_lock = asyncio.Lock()
        self._inflight: dict[str, RequestTimeline] = {}
        self._cleanups: set[asyncio.Task] = set()
        self.timelines: collections.deque[RequestTimeline] = collections.deque(maxlen=keep_timelines)
        self.plans: collections.deque[dict] = collections.deque(maxlen=64)

    @property
    def improvement_rate(self) -> float | None:
        return self.control.improvement_rate

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[OutputDelta]:
        """Stream one request's outputs; closing the iterator early aborts it everywhere.

        A request whose prefill worker or decode instance dies under it (``InstanceLost``) is
        run again, up to ``retries`` times: planned anew, routed to a decode instance that is
        up (waiting up to ``retry_wait_s`` for one), and resumed from the output tokens its
        client already has (``_attempt``). The client sees one stream, each token once.
        """
        # The prompt stays the request's int32 array on every hop (tetris/token_ids.py).
        rid, prompt = req.request_id, req.prompt_token_ids
        if rid in self._inflight:
            raise ValueError(f"request {rid!r} is already running")
        if len(self._inflight) >= self.max_pending:
            raise Overloaded(f"{len(self._inflight)} requests in flight (limit {self.max_pending})")
        # The ingress's arrival stamp is another process's clock: time from here on.
        tl = RequestTimeline(rid, len(prompt), arrival=self.clock())
        self._inflight[rid] = tl
        sent = ClientProgress()
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._attempt(req, tl, sent)) as attempt:
                        async for out in attempt:
                            if isinstance(out, DecodeHandoff):
                                yield out
                                continue
                            if isinstance(out, RelayReport):   # the relayed stream ended
                                tl.outcome = out.finish_reason or "stop"
                                return
                            sent.token_ids.extend(out.new_token_ids)
                            sent.chars += len(out.new_text)
                            yield out
                            if out.finished:
                                tl.outcome = out.finish_reason or "stop"
                                return
                    raise RuntimeError(f"request {rid}: the decode stream ended without a final output")
                except InstanceLost as e:
                    # A run lost to an outdated plan lost no work on the dead worker: it is not
                    # charged against ``retries`` (a few times at most: each needs a new death).
                    outdated = isinstance(e, PlanOutdated) and sent.outdated < _OUTDATED_RUNS
                    if tl.retries - sent.outdated >= self.retries and not outdated:
                        raise
                    sent.outdated += outdated
                    prefix_cache.forget_missing(self.control, e)
                    log.warning("request %s lost its instance during %s (%s); running it again "
                                "from its %d output tokens", rid, sent.stage, e, len(sent.token_ids))
                    await self._free(attempt_id(rid, tl.retries), tl.decode_instance, completed=False)
                    sent.lost_decode = tl.decode_instance if sent.stage == "decode" else None
                    tl.retries += 1
                    if self.metrics is not None:
                        self.metrics.count_retry(sent.stage)
        except (Overloaded, ValueError):
            tl.outcome = "refused"
            raise
        except GeneratorExit:
            tl.outcome = "aborted"
            raise
        except asyncio.CancelledError:
            tl.outcome = "aborted"
            raise
        except Exception as e:
            tl.outcome = "error"
            log.warning("request %s failed during %s: %s", rid, sent.stage, e)
            raise
        finally:
            # The cleanup outlives a cancelled caller. It runs in a fresh context: Ray Serve
            # cancels the handle calls a cancelled request made (it finds them through the
            # context), which would cancel the very aborts that free the request's KV. The loop
            # keeps only a weak reference to a task, so the dispatcher holds it until done.
            aid = attempt_id(rid, tl.retries)
            # a run split over a decode group is not kept: its master holds only its range
            keep = tl.outcome in COMPLETED and not (self.elastic and self.elastic.ranges(aid))
            drops = prefix_cache.finished_run(self, req, aid, tl, sent.token_ids, keep)
            task = asyncio.get_running_loop().create_task(self._cleanup(rid, tl, drops),
                                                          context=contextvars.Context())
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
            await asyncio.shield(task)

    async def _attempt(self, req: GenerateRequest, tl: RequestTimeline,
                       sent: ClientProgress) -> AsyncIterator[OutputDelta]:
        """One run of the request: route, plan, prefill, decode. A run after a lost instance
        prefills the prompt plus the output tokens the client has and decodes on from them;
        its outputs are trimmed to what the client does not have yet."""
        rid, aid = req.request_id, attempt_id(req.request_id, tl.retries)
        resumed = tuple(sent.token_ids)
        prompt = req.prompt_token_ids
        if resumed:
            prompt = compact_tokens(prompt) + TokenIds("i", resumed)
        sent.stage = "routing"
        run_kw: dict = {}   # the prefix already on the decode instance: not streamed
        if tl.retries:
            instance = await self._reroute(req, aid, tl, sent)
            sent.stage = "planning"
            plan = await self._plan(aid, len(prompt), tl, prompt)
        elif (kept := await prefix_cache.route_to_kept(self, req, aid, tl)) is not None:
            instance, plan, run_kw = kept
        else:
            # The decode instance reserves the request's blocks while the plan is made.
            instance, reserve = self._route_reserve(req, aid, tl)
            reserving = asyncio.ensure_future(reserve)
            sent.stage = "planning"
            try:
                plan = await self._plan(aid, len(prompt), tl, prompt)
            except BaseException:
                reserving.cancel()   # what it reserved is aborted with the run
                with contextlib.suppress(BaseException):
                    await reserving
                raise
            # Refused here (no KV room), the committed plan is aborted with the run.
            await reserving
        sent.stage = "prefill"
        receivers = self.decode.receiver_ids(instance)
        if (group := self.elastic and self.elastic.ranges(aid)) is not None:
            # each range streams to its holder (elastic decode, tetris/serve/elastic_dispatch.py)
            run_kw = {"kv_ranges": self.elastic.kv_ranges(aid, self.decode.receiver_ids)}
            receivers = ()
        result = await self.prefill.run(plan, prompt, req.sampling, receivers, **run_kw)
        if not resumed:   # the run that gives the client its first token times the TTFT
            tl.prefill_end = self.clock()
            tl.prefill_start = tl.prefill_end - float(result.elapsed_s)
            tl.turn_wait_s = float(result.turn_wait_s)
            if self.metrics is not None:
                self.metrics.observe_queue(max(0.0, tl.prefill_start - tl.arrival))
        self.control.prefill_done(aid, self.clock())
        await prefix_cache.index_run(self.control, self.prefill, aid)
        sent.stage = "decode"
        first_logprob = getattr(result, "first_logprob", None)   # when logprobs were asked for
        # a prefix-cache hit is told once, on the client's first output
        cached = 0 if resumed or sent.token_ids else plan.cached_tokens
        cursor: StreamCursor | None = None
        if resumed:
            cursor = StreamCursor(len(resumed), sent.chars)
        elif self.first_token is not None:
            cursor = self.first_token.open(req, int(result.first_token), first_logprob)
            if cursor is not None:
                tl.first_token = self.clock()
                first, cached = prefix_cache.told(cursor.first, cached)
                yield first
        # the logprob goes along only when asked for (clients without logprobs need not take it)
        extra = () if first_logprob is None else (first_logprob,)
        if group is not None:   # the master starts once every holder has its range
            await self.decode.elastic_commit(aid, group, int(result.first_token), *extra)
        elif not getattr(result, "first_token_streamed", False):
            # else the sampling member sent the token with the KV: the instance has it
            await self.decode.commit(instance, aid, int(result.first_token), *extra)
        if self.relay:   # the ingress streams the decode outputs itself (tetris.serve.relay)
            self._relay.open(aid)
            yield DecodeHandoff(rid, aid, instance, *(cursor.sent if cursor else (0, 0)),
                                cached_tokens=cached)
            yield await self._relay_end(aid, tl, sent)
            return
        kv_arrived = False
        async with contextlib.aclosing(self.decode.stream(instance, aid)) as stream:
            async for out in stream:
                if not kv_arrived:
                    kv_arrived = True
                    await self._kv_arrived(aid, tl)
                tl.tokens = out.num_tokens
                if cursor is not None and (out := cursor.follow(out)) is None:
                    continue
                if out.request_id != rid:   # under the client's id, whichever run made it
                    out = msgspec.structs.replace(out, request_id=rid)
                out, cached = prefix_cache.told(out, cached)
                yield out
                if out.finished:
                    return

    async def _relay_end(self, aid: str, tl: RequestTimeline, sent: ClientProgress) -> RelayReport:
        """Wait for a relayed run's reports: the KV's arrival, then how its stream ended."""
        box, kv_arrived = self._relay.open(aid), False
        while True:
            report = await box.get()
            # Two calls from the ingress may arrive in either order: a stream's end that
            # overtook its arrival report says as much, the KV arrived (it made outputs).
            if not kv_arrived and (report.kind == "kv_arrived" or report.num_tokens):
                kv_arrived = True
                await self._kv_arrived(aid, tl)
            if report.kind == "kv_arrived":
                continue
            sent.token_ids.extend(report.token_ids)
            sent.chars += report.chars
            tl.tokens = max(tl.tokens, report.num_tokens)
            if report.kind == "finished":
                return report
            if report.kind == "lost":
                raise InstanceLost(report.error)
            raise RuntimeError(f"decode stream of {aid}: {report.error}")

    def relay_report(self, run_id: str, report: RelayReport) -> bool:
        """A report from the ingress on a relayed run (False: the run is gone)."""
        return self._relay.deliver(run_id, report)

    async def _plan(self, aid: str, prompt_tokens: int, tl: RequestTimeline,
                    prompt: Sequence[int] | None = None) -> PrefillPlan:
        control = self.control
        hashes = prefix_cache.block_hashes(control, prompt)
        async with self._plan_lock:
            if tl.retries:
                # A run again after a lost worker: the last report predates the loss, and the
                # instance being replaced is to be planned around, so ask the pool now.
                await self._pool_report()
            now = self.clock()
            arrival = not tl.retries   # a run again is not an arrival: θ does not move
            theta = control.improvement_rate
            for tries in range(1, _PLAN_TRIES + 1):
                plan = control.plan(aid, prompt_tokens, now, arrival=arrival, **hashes)
                arrival = False
                try:
                    # The last try is let wait for a replacement: the policy chose the
                    # instance knowing (every other one is busier still).
                    busy = await self.prefill.commit(plan, wait_replacing=tries == _PLAN_TRIES)
                    break
                except InstanceReplacing as e:
                    # A worker was found dead since the last report: plan around it.
                    log.info("plan of %s refused (%s); planning it again", aid, e)
                    await self._pool_report()
                    now = self.clock()
            control.commit(plan)
            if busy is not None:
                control.pool_report(busy, self.clock())
        if self.metrics is not None and control.improvement_rate != theta:
            self.metrics.set_improvement_rate(control.improvement_rate)
        tl.planned = self.clock()
        tl.chunks = len(plan.chunks)
        tl.sp_sizes = tuple(c.sp_size for c in plan.chunks)
        tl.ttft_estimate = plan.ttft_estimate
        if hashes and self.metrics is not None:
            self.metrics.count_prefix_query(plan.cached_tokens)
        self.plans.append(msgspec.to_builtins(plan))
        if self.metrics is not None:
            self.metrics.observe_plan(list(tl.sp_sizes))
        return plan

    async def _pool_report(self) -> None:
        busy = await self.prefill.busy_for()
        if busy is not None:
            self.control.pool_report(busy, self.clock())
