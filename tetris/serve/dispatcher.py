"""The dispatcher: plans each request's prefill, routes its decode and drives both to the end.

It holds the control state of the cluster and nothing heavy:

- ``LiveQueue``: per prefill instance, until when it is busy. A committed plan books its chunks'
  expected ends; a finished prefill removes its bookings, so an instance that finished early
  is free at once and one that runs late stays busy until it reports (queue times "corrected
  by actual chunk completion times"). The policy plans against ``LiveQueue.pool_state(now)``.
- the active ``Policy`` (Tetris CDSP by default) with θ from the ``RateMonitor``;
- the ``DecodeRouter`` (Llumnix virtual usage): a request's KV tokens count against its
  decode instance from routing until its KV has arrived;
- a bounded admission count: beyond ``max_pending`` requests in flight, ``Overloaded``.

Lifecycle of one request (``generate``), on the dispatcher's monotonic clock:

1. route: choose a decode instance, book the request's KV tokens there (virtual usage), and
   reserve its KV blocks on the instance (``decode.reserve``); no room -> ``Overloaded``;
2. plan under the planning lock (so plans commit in the order they were made), book the
   chunks in the live queue and register them with the pool (``prefill.commit``). A plan the
   pool refuses (``InstanceReplacing``: a worker found dead since its last report) is made
   again around the instance on a fresh report, before anything ran;
3. run the plan (``prefill.run``): chunks stream their KV layer by layer to the decode
   instance's TP ranks; the result carries the first token, which this generator yields at
   once (``first_token``: TTFT ends with the prefill, the KV hand-off is not in it);
4. hand the first token to the decode instance (``decode.commit``); it admits the request
   once every rank has all the KV, then streams tokens, which this generator yields;
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

The two sides are reached through ``PrefillClient`` and ``DecodeClient``: Serve deployment
handles in the app (``tetris.serve.app``), plain objects in tests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import msgspec

from tetris.config import DeploymentConfig
from tetris.engine.request import OutputDelta
from tetris.errors import InstanceLost, InstanceReplacing, PlanOutdated
from tetris.plan import PrefillPlan
from tetris.scheduler.latency import PrefillLatencyModel, PrefillProfile, load_profile
from tetris.scheduler.policies import policy_from_config
from tetris.scheduler.pool import PoolState
from tetris.scheduler.rate import ImprovementRateTable, RateMonitor
from tetris.scheduler.router import DecodeRouter, NoInstanceUp
from tetris.serve.backend import Overloaded
from tetris.serve.first_token import EarlyFirstToken, StreamCursor
from tetris.serve.metrics import ServingMetrics
from tetris.serve.protocol import GenerateRequest
from tetris.token_ids import TokenIds, compact_tokens

__all__ = ["Dispatcher", "LiveQueue", "PrefillClient", "DecodeClient", "RequestTimeline",
           "DEFAULT_PROFILE"]

log = logging.getLogger(__name__)

DEFAULT_PROFILE = "a100-llama3-8b-tp1"
_COMPLETED = ("stop", "length")   # finish reasons after which nothing is left to abort
_HOLD = "\x00hold"                # the booking key of a drain hold (no request id has it)
_RETRY = "#retry"                 # a run of a request after a lost instance: "<id>#retry<n>"
_PLAN_TRIES = 3                   # plans per run refused for instances being replaced, at most
_OUTDATED_RUNS = 4                # runs again for outdated plans, beyond ``retries``


def _attempt_id(request_id: str, retries: int) -> str:
    """The id the pools know run ``retries`` of a request by: the request's own id for the first
    run, a fresh one for each run again (a lost instance may still hold the earlier run)."""
    return request_id if not retries else f"{request_id}{_RETRY}{retries}"


class _Sent:
    """What the client of one request already has, and where its current run is."""

    __slots__ = ("token_ids", "chars", "stage", "lost_decode", "outdated")

    def __init__(self) -> None:
        self.token_ids: list[int] = []         # output tokens yielded so far
        self.chars = 0                         # characters of text yielded so far
        self.stage = "routing"
        self.lost_decode: int | None = None    # the decode instance the last run lost
        self.outdated = 0                      # runs again for outdated plans (not charged)


class PrefillClient(Protocol):
    # PrefillPool.commit: returns its busy_for; raises InstanceReplacing
    async def commit(self, plan: PrefillPlan,
                     wait_replacing: bool = False) -> Sequence[float] | None: ...
    async def busy_for(self) -> Sequence[float] | None: ...
    async def run(self, plan: PrefillPlan, token_ids: TokenIds, sampling, kv_receivers) -> Any: ...
    async def release(self, request_id: str) -> None: ...
    async def abort(self, request_id: str) -> None: ...


class DecodeClient(Protocol):
    def receiver_ids(self, instance: int) -> tuple[int, ...]: ...
    async def reserve(self, instance: int, request_id: str, prompt: TokenIds, sampling,
                      generated: tuple[int, ...] = ()) -> None: ...
    async def commit(self, instance: int, request_id: str, first_token: int) -> None: ...
    def stream(self, instance: int, request_id: str) -> AsyncIterator[OutputDelta]: ...
    async def abort(self, instance: int, request_id: str) -> None: ...
    async def stats(self) -> list[Any]: ...


class LiveQueue:
    """Per-instance busy-until times from committed plans, corrected by completions and by
    what the pool reports.

    Bookings say when each chunk was *planned* to end. When the pool runs late (a worker died
    and its replacement started, a chunk ran long), bookings past their end say "free now" while
    the pool still has that work queued, and the policy would plan onto an idle pool that is not
    idle. The pool answers each commit with how long each instance is still busy by its tickets
    (``PrefillPool.busy_for``); ``observe`` keeps that as a floor. An instance whose worker is
    being replaced (reported infinite) counts as busy ``REPLACING_S`` more, then is reported
    again with the next commit.
    """

    REPLACING_S = 60.0

    def __init__(self, node_of: Sequence[int]) -> None:
        self.node_of = tuple(node_of)
        self._booked: list[dict[str, float]] = [{} for _ in self.node_of]
        self._reported = [0.0] * len(self.node_of)   # busy-until by the pool's last report

    def commit(self, plan: PrefillPlan) -> None:
        for chunk in plan.chunks:
            for i in chunk.instances:
                prev = self._booked[i].get(plan.request_id, 0.0)
                self._booked[i][plan.request_id] = max(prev, chunk.expected_end)

    def finish(self, request_id: str) -> None:
        for booked in self._booked:
            booked.pop(request_id, None)

    def hold(self, instances: Sequence[int], until: float) -> None:
        """Drain: plan no work on ``instances`` before ``until`` (maintenance, warm-up)."""
        for i in instances:
            if not 0 <= i < len(self._booked):
                raise ValueError(f"no prefill instance {i} (pool of {len(self._booked)})")
        for i in instances:
            self._booked[i][_HOLD] = until

    def observe(self, busy_for: Sequence[float], now: float) -> None:
        """The pool's report at ``now``: per instance, seconds of committed work left."""
        if len(busy_for) != len(self._reported):
            raise ValueError(f"the pool reported {len(busy_for)} instances, the queue has "
                             f"{len(self._reported)}")
        self._reported = [now + min(float(b), self.REPLACING_S) for b in busy_for]

    def queue_times(self, now: float) -> list[float]:
        # A booking past its expected end is a chunk running late: busy now, end unknown,
        # unless the pool's report knows better.
        return [max([now, r, *b.values()]) for b, r in zip(self._booked, self._reported)]

    def pool_state(self, now: float) -> PoolState:
        return PoolState(self.queue_times(now), self.node_of)

    def bookings(self) -> int:
        """Requests' bookings (drain holds are not requests)."""
        return sum(len(b) - (_HOLD in b) for b in self._booked)


class RequestTimeline(msgspec.Struct):
    """Where one request's time went (dispatcher clock, seconds); the TTFT breakdown."""

    request_id: str
    prompt_tokens: int
    arrival: float
    decode_instance: int = -1
    planned: float = 0.0          # plan committed
    prefill_start: float = 0.0    # first chunk started (prefill end minus its elapsed time)
    prefill_end: float = 0.0      # first token known
    turn_wait_s: float = 0.0      # of the prefill, waiting for later chunks' turns on their members
    first_token: float = 0.0      # the first token was yielded (0: not early, see first_token.py)
    first_output: float = 0.0     # the decode instance streamed its first output
    finished: float = 0.0
    chunks: int = 0
    sp_sizes: tuple[int, ...] = ()
    ttft_estimate: float = 0.0
    tokens: int = 0
    outcome: str = ""
    retries: int = 0              # runs again after a lost prefill worker or decode instance

    def breakdown(self) -> dict[str, float]:
        """queue (planning, and the first chunk's wait for its turn on its members), prefill
        (from the first chunk's start; ``turn_wait_s`` of it waiting for later chunks' turns),
        and hand-off (KV transfer tail + admission + first decode round); TTFT ends with the
        first token's yield, or with the first decode output."""
        return {"queue_s": self.prefill_start - self.arrival,
                "prefill_s": self.prefill_end - self.prefill_start,
                "turn_wait_s": self.turn_wait_s,
                "handoff_s": self.first_output - self.prefill_end,
                "ttft_s": (self.first_token or self.first_output) - self.arrival}


class Dispatcher:
    def __init__(self, deployment: DeploymentConfig, prefill: PrefillClient, decode: DecodeClient,
                 *, node_of: Sequence[int], decode_capacities: Sequence[int],
                 metrics: ServingMetrics | None = None, max_pending: int = 256,
                 rate_table: ImprovementRateTable | None = None,
                 clock: Callable[[], float] = time.monotonic, keep_timelines: int = 1024,
                 first_token: EarlyFirstToken | None = None, retries: int = 2,
                 retry_wait_s: float = 60.0, retry_poll_s: float = 0.5) -> None:
        if retries < 0 or retry_wait_s < 0 or retry_poll_s <= 0:
            raise ValueError(f"retries and retry_wait_s must be >= 0 and retry_poll_s > 0, got "
                             f"{retries}, {retry_wait_s}, {retry_poll_s}")
        self.retries = retries
        self.retry_wait_s = retry_wait_s
        self.retry_poll_s = retry_poll_s
        self.deployment = deployment
        self.first_token = first_token   # None: the first token comes with the decode stream
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.max_pending = max_pending
        self.clock = clock
        sc = deployment.scheduler
        self.profile = load_profile(sc.profile or DEFAULT_PROFILE)
        self.policy = self._make_policy(self.profile)
        self.queue = LiveQueue(node_of)
        self.router = DecodeRouter(decode_capacities)
        if metrics is not None:
            for i in range(self.router.num_instances):
                metrics.set_decode_up(i, True)
        self.monitor = self._make_monitor(rate_table)
        self.improvement_rate = (self.monitor.improvement_rate if self.monitor is not None
                                 else sc.improvement_rate)
        self._plan_lock = asyncio.Lock()
        self._inflight: dict[str, RequestTimeline] = {}
        self._virtual: dict[str, tuple[int, int]] = {}   # request -> (decode instance, kv tokens)
        self._cleanups: set[asyncio.Task] = set()
        self.timelines: collections.deque[RequestTimeline] = collections.deque(maxlen=keep_timelines)
        self.plans: collections.deque[dict] = collections.deque(maxlen=64)

    # -- configuration ----------------------------------------------------------------------
    def _make_policy(self, profile: PrefillLatencyModel):
        return policy_from_config(self.deployment.scheduler, profile=profile)

    def _make_monitor(self, table: ImprovementRateTable | None) -> RateMonitor | None:
        sc = self.deployment.scheduler
        if table is None and sc.rate_table:
            table = ImprovementRateTable.load(_rate_table_path(sc.rate_table))
        if table is None:
            return None   # θ stays at scheduler.improvement_rate
        return RateMonitor(sc.rate_window_s, sc.rate_update_interval_s, table,
                           min_arrivals=sc.rate_min_arrivals)

    def rate_table(self) -> dict:
        if self.monitor is None:
            return {"rates": [], "improvement_rates": [], "description": "no table: fixed θ",
                    "improvement_rate": self.improvement_rate}
        t = self.monitor.table
        return {"rates": list(t.rates), "improvement_rates": list(t.improvement_rates),
                "description": t.description, "improvement_rate": self.improvement_rate}

    def set_rate_table(self, rates: list[float], improvement_rates: list[float],
                       description: str = "") -> dict:
        """Replace the θ table (admin route); raises ``RateTableError`` for a bad table."""
        table = ImprovementRateTable(rates, improvement_rates, description=description)
        if self.monitor is None:
            self.monitor = self._make_monitor(table)
        else:
            self.monitor.replace_table(table)
        return self.rate_table()

    def latency_profile(self) -> dict:
        return msgspec.to_builtins(self.profile.to_profile())

    def set_latency_profile(self, body: dict) -> dict:
        """Replace the prefill latency profile (admin route); the policy is rebuilt on it."""
        model = PrefillLatencyModel.from_profile(msgspec.convert(body, PrefillProfile))
        self.policy = self._make_policy(model)
        self.profile = model
        return self.latency_profile()

    def drain(self, instances: Sequence[int], seconds: float) -> dict:
        """Keep new plans off ``instances`` for ``seconds`` (admin route); running work goes on."""
        if not 0 < seconds <= 3600:
            raise ValueError(f"seconds must be in (0, 3600], got {seconds}")
        self.queue.hold([int(i) for i in instances], self.clock() + seconds)
        return self.stats()

    def set_decode_up(self, instance: int, up: bool) -> None:
        """Route new requests to decode ``instance`` again, or stop (it broke and is being
        restarted); requests already there end as the instance lets them."""
        self.router.set_up(int(instance), bool(up))
        if self.metrics is not None:
            self.metrics.set_decode_up(int(instance), bool(up))

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
        sent = _Sent()
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._attempt(req, tl, sent)) as attempt:
                        async for out in attempt:
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
                    log.warning("request %s lost its instance during %s (%s); running it again "
                                "from its %d output tokens", rid, sent.stage, e, len(sent.token_ids))
                    await self._free(_attempt_id(rid, tl.retries), tl.decode_instance, completed=False)
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
            task = asyncio.get_running_loop().create_task(self._cleanup(rid, tl),
                                                          context=contextvars.Context())
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
            await asyncio.shield(task)

    async def _attempt(self, req: GenerateRequest, tl: RequestTimeline,
                       sent: "_Sent") -> AsyncIterator[OutputDelta]:
        """One run of the request: route, plan, prefill, decode. A run after a lost instance
        prefills the prompt plus the output tokens the client has and decodes on from them;
        its outputs are trimmed to what the client does not have yet."""
        rid, aid = req.request_id, _attempt_id(req.request_id, tl.retries)
        resumed = tuple(sent.token_ids)
        prompt = req.prompt_token_ids
        if resumed:
            prompt = compact_tokens(prompt) + TokenIds("i", resumed)
        sent.stage = "routing"
        instance = await (self._route(req, aid, tl) if not tl.retries
                          else self._reroute(req, aid, tl, sent))
        sent.stage = "planning"
        plan = await self._plan(aid, len(prompt), tl)
        sent.stage = "prefill"
        result = await self.prefill.run(plan, prompt, req.sampling,
                                        self.decode.receiver_ids(instance))
        if not resumed:   # the run that gives the client its first token times the TTFT
            tl.prefill_end = self.clock()
            tl.prefill_start = tl.prefill_end - float(result.elapsed_s)
            tl.turn_wait_s = float(result.turn_wait_s)
            if self.metrics is not None:
                self.metrics.observe_queue(max(0.0, tl.prefill_start - tl.arrival))
        self.queue.finish(aid)
        sent.stage = "decode"
        cursor: StreamCursor | None = None
        if resumed:
            cursor = StreamCursor(len(resumed), sent.chars)
        elif self.first_token is not None:
            cursor = self.first_token.open(req, int(result.first_token))
            if cursor is not None:
                tl.first_token = self.clock()
                yield cursor.first
        await self.decode.commit(instance, aid, int(result.first_token))
        kv_arrived = False
        async with contextlib.aclosing(self.decode.stream(instance, aid)) as stream:
            async for out in stream:
                if not kv_arrived:
                    kv_arrived = True
                    tl.first_output = tl.first_output or self.clock()
                    await self._kv_arrived(aid)
                tl.tokens = out.num_tokens
                if cursor is not None and (out := cursor.follow(out)) is None:
                    continue
                if out.request_id != rid:   # under the client's id, whichever run made it
                    out = msgspec.structs.replace(out, request_id=rid)
                yield out
                if out.finished:
                    return

    async def _route(self, req: GenerateRequest, aid: str, tl: RequestTimeline,
                     avoid: frozenset[int] = frozenset(), generated: tuple[int, ...] = ()) -> int:
        kv_tokens = len(req.prompt_token_ids) + req.sampling.max_tokens
        try:
            instance = self.router.choose(kv_tokens, avoid)
        except NoInstanceUp as e:
            raise Overloaded(f"{e}: restarting, retry shortly", retry_after_s=2.0) from None
        self.router.reserve(instance, kv_tokens)
        self._virtual[aid] = (instance, kv_tokens)
        tl.decode_instance = instance
        await self.decode.reserve(instance, aid, req.prompt_token_ids, req.sampling, generated)
        return instance

    async def _reroute(self, req: GenerateRequest, aid: str, tl: RequestTimeline,
                       sent: "_Sent") -> int:
        """Route a run after a lost instance: another decode instance if one is up, else the
        lost one once it is back (restarted by its healer); ``retry_wait_s`` at most."""
        avoid = frozenset() if sent.lost_decode is None else frozenset({sent.lost_decode})
        deadline = self.clock() + self.retry_wait_s
        while True:
            try:
                return await self._route(req, aid, tl, avoid, tuple(sent.token_ids))
            except Overloaded as e:
                self._release_virtual(aid)
                if self.clock() >= deadline:
                    raise RuntimeError(f"request {req.request_id}: no decode instance took it back "
                                       f"within {self.retry_wait_s:g} s of losing its own: {e}") from None
                await asyncio.sleep(self.retry_poll_s)

    async def _plan(self, aid: str, prompt_tokens: int, tl: RequestTimeline) -> PrefillPlan:
        async with self._plan_lock:
            if tl.retries:
                # A run again after a lost worker: the last report predates the loss, and the
                # instance being replaced is to be planned around, so ask the pool now.
                busy = await self.prefill.busy_for()
                if busy is not None:
                    self.queue.observe(busy, self.clock())
            now = self.clock()
            if not tl.retries:   # a run again is not an arrival
                self._update_theta(now)
            for tries in range(1, _PLAN_TRIES + 1):
                plan = self.policy.plan(aid, prompt_tokens, now, self.queue.pool_state(now),
                                        improvement_rate=self.improvement_rate)
                try:
                    # The last try is let wait for a replacement: the policy chose the
                    # instance knowing (every other one is busier still).
                    busy = await self.prefill.commit(plan, wait_replacing=tries == _PLAN_TRIES)
                    break
                except InstanceReplacing as e:
                    # A worker was found dead since the last report: plan around it.
                    log.info("plan of %s refused (%s); planning it again", aid, e)
                    busy = await self.prefill.busy_for()
                    if busy is not None:
                        self.queue.observe(busy, self.clock())
                    now = self.clock()
            self.queue.commit(plan)
            if busy is not None:
                self.queue.observe(busy, self.clock())
        tl.planned = self.clock()
        tl.chunks = len(plan.chunks)
        tl.sp_sizes = tuple(c.sp_size for c in plan.chunks)
        tl.ttft_estimate = plan.ttft_estimate
        self.plans.append(msgspec.to_builtins(plan))
        if self.metrics is not None:
            self.metrics.observe_plan(list(tl.sp_sizes))
        return plan

    def _update_theta(self, now: float) -> None:
        if self.monitor is None:
            return
        self.monitor.observe_arrival(now)
        theta = self.monitor.maybe_update(now)
        if theta is not None:
            self.improvement_rate = theta
            if self.metrics is not None:
                self.metrics.set_improvement_rate(theta)

    def _release_virtual(self, aid: str) -> None:
        """Drop a run's virtual usage on its decode instance, if it still has any."""
        entry = self._virtual.pop(aid, None)
        if entry is not None:
            self.router.release(*entry)

    async def _kv_arrived(self, aid: str) -> None:
        """The decode instance has all the KV: drop the prefill copy and the virtual usage."""
        self._release_virtual(aid)
        await self.prefill.release(aid)

    async def _cleanup(self, rid: str, tl: RequestTimeline) -> None:
        """Free everything the request still holds; every step is idempotent."""
        tl.finished = self.clock()
        self._inflight.pop(rid, None)
        await self._free(_attempt_id(rid, tl.retries), tl.decode_instance,
                         completed=tl.outcome in _COMPLETED)
        self.timelines.append(tl)

    async def _free(self, aid: str, decode_instance: int, *, completed: bool) -> None:
        """Free what one run of a request holds: bookings, virtual usage and, unless it
        completed, its state on both pools (a lost instance's answers are logged, not raised)."""
        self.queue.finish(aid)
        self._release_virtual(aid)
        if completed:
            return
        try:
            await self.prefill.abort(aid)
        except Exception as e:  # noqa: BLE001 - cleanup must reach every side
            log.warning("cleanup of %s on the prefill pool: %s", aid, e)
        if decode_instance >= 0:
            try:
                await self.decode.abort(decode_instance, aid)
            except Exception as e:  # noqa: BLE001
                log.warning("cleanup of %s on decode instance %d: %s", aid, decode_instance, e)

    # -- load -------------------------------------------------------------------------------
    async def refresh_decode_load(self) -> list[Any]:
        """Pull the decode instances' load into the router (free slots, batch size)."""
        stats = await self.decode.stats()
        for i, s in enumerate(stats):
            if s is not None:
                self.router.update(i, s.free_blocks * s.block_size, s.running)
        return stats

    def stats(self) -> dict:
        now = self.clock()
        return {"running": len(self._inflight), "waiting": 0,
                "improvement_rate": self.improvement_rate,
                "decode_down": sorted(self.router.down),
                "queue_times": [t - now for t in self.queue.queue_times(now)]}

    def held(self) -> dict:
        """What is still reserved on the control side (zero everywhere when idle)."""
        return {"inflight": len(self._inflight), "queue_bookings": self.queue.bookings(),
                "virtual_usage": sum(self.router.virtual), "virtual_requests": len(self._virtual),
                "cleanups": len(self._cleanups)}


def _rate_table_path(name: str) -> str:
    from pathlib import Path
    from importlib import resources

    p = Path(name)
    if p.exists():
        return str(p)
    embedded = Path(str(resources.files("tetris.configs").joinpath("rates", name)))
    return str(embedded if embedded.exists() else p)
