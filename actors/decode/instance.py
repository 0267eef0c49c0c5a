"""The driver of one decode instance: its TP rank actors, the round loop and per-request streams.

Lifecycle of a request fed by KV streaming:

1. ``await reserve(id, prompt, sampling)``: a ``Reserve`` goes to every rank in the next round;
   each engine replica holds the prompt's blocks and each rank's receive manager expects the
   request. Raises ``DecodeFull`` without room. The prefill may start once this returns.
2. Senders stream each rank its KV head slice; each rank reports ``ready`` on its own time.
3. ``commit(id, first_token)``: the prefill's first token. Once the token is known AND every
   rank reported ready (either order), a ``Commit`` joins the next round's commands.
4. ``stream(id)`` yields the engine's outputs (rank 0's) as ``OutputDelta``s, first token
   first, until finished; deltas that queued while the consumer was busy leave merged.
5. A transfer failure on any rank aborts the request on every rank and the stream raises
   ``DecodeError``; ``abort(id)`` does the same at the caller's request (idempotent). When the
   instance itself breaks (a rank died), every request fails with ``DecodeInstanceLost``: the
   dispatcher runs them again elsewhere, resuming each from the tokens its client already has
   (``reserve(..., generated=...)``).

``add`` is the local path: the decode instance prefills the prompt itself.

The round loop is one asyncio task: it sends the pending commands to rank 0, which runs the
round on every rank over their gloo group and answers with all ranks' replies (one Ray call
per round, ``lockstep.py``); it routes outputs and transfer events, and sleeps on an event
when there is nothing to do; while KV is arriving it wakes every ``poll_interval_s`` to
collect ranks' ready events.
The requests' bookkeeping (live and ended requests, the next round's commands, what replies do
to them) is ``requests.RequestBook``'s; breaking, checking and restarting the instance is
``instance_health.InstanceHealth``'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator

import ray

from tetris.actors.decode.instance_health import InstanceHealth
from tetris.actors.decode.messages import (Abort, Add, Command, DecodeError, DecodeFull,
                                           DecodeInstanceLost, Reserve, StepReply)
from tetris.actors.decode.rank import DecodeRankActor
from tetris.actors.decode.requests import RequestBook, RequestState
from tetris.actors.placement import PLACEMENT_TIMEOUT_S, Placement, place_decode
from tetris.config import DeploymentConfig, TransferConfig
from tetris.engine.engine import EngineStats
from tetris.engine.request import OutputDelta, TokenLogprob
from tetris.model.loader import resolve_model_config
from tetris.sampling_params import SamplingParams
from tetris.token_ids import compact_tokens
from tetris.transfer.messages import AgentInfo

__all__ = ["DecodeInstance", "DecodeFull", "DecodeError", "DecodeInstanceLost"]

log = logging.getLogger(__name__)


class DecodeInstance(InstanceHealth):
    def __init__(self, deployment: DeploymentConfig, instance: int, *,
                 transfer: TransferConfig | None, placement: str | None = None, seed: int = 0,
                 timeout_s: float = 60.0, poll_interval_s: float = 0.003,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
                 lockstep_timeout_s: float | None = None) -> None:
        self.deployment = deployment
        self.instance = instance
        # EMULATION: one rank actor stands for the whole TP group (its engine still takes the
        # deployment's TP size for latency), so the control plane of a TP-8 instance costs one
        # actor's Ray calls on a small machine.
        self.tp_size = 1 if deployment.decode.executor == "emulated" else deployment.decode.tp_size
        self.transfer = transfer
        self.placement_mode = placement   # None: decode.placement of the deployment
        self.placement_timeout_s = placement_timeout_s
        self.placement: Placement | None = None
        self.seed = seed
        self.timeout_s = timeout_s
        # how long rank 0 waits for the other ranks' replies to a round (lockstep.py)
        self.lockstep_timeout_s = timeout_s if lockstep_timeout_s is None else lockstep_timeout_s
        self.poll_interval_s = poll_interval_s
        self.ranks: list = []
        # KV blocks each rank holds and their size, as the ranks report them at start
        # (``_read_kv_blocks``); the dispatcher plans with ``kv_capacity_tokens``
        self.kv_blocks = 0
        self.block_size = deployment.decode.block_size
        self._book = RequestBook(instance, self.tp_size)   # requests, ended ones, commands
        self._loop_task: asyncio.Task | None = None
        self._stats: EngineStats | None = None
        self._broken: BaseException | None = None
        self._restarting = False
        self._answered_at = -math.inf   # when every rank last answered a round
        self.restarts = 0
        self._senders: dict[int, object] = {}   # kept to connect replacement ranks
        self._agent_infos: list[AgentInfo] = []
        self.rounds = 0   # rounds sent to the ranks (tests check that idle means no rounds)
        self.gate = None  # elastic decode: the world's round gate (actors/decode/elastic_pool.py)
        # held by KunServe's group driver while it drops or restores (actors/decode/kunserve_group.py)
        self.round_lock = asyncio.Lock()
        # rank 0's engine step time of recent rounds that produced tokens (benchmarks)
        self.step_times: collections.deque[float] = collections.deque(maxlen=4096)
        # wall time of the same rounds as seen here (step + Ray calls + lockstep wait)
        self.round_times: collections.deque[float] = collections.deque(maxlen=4096)

    # -- setup ----------------------------------------------------------------------------
    @property
    def receiver_ids(self) -> tuple[int, ...]:
        return tuple(self.instance * self.tp_size + r for r in range(self.tp_size))

    async def start(self) -> None:
        """Place and spawn the ranks, form the TP group, load the model, enable transfer when
        given. With placement, rank r runs in bundle r of the instance's STRICT_PACK group, so
        the TP group never spans nodes (actors/placement.py)."""
        # Waiting for a placement group blocks: keep the event loop (a Serve replica's) free.
        self.placement = await asyncio.to_thread(
            place_decode, self.deployment.decode, self.instance, mode=self.placement_mode,
            timeout_s=self.placement_timeout_s)
        self.ranks = [DecodeRankActor.options(**self.placement.options(r)).remote(
            self.instance, r, self.tp_size, self.deployment, seed=self.seed)
            for r in range(self.tp_size)]
        host, port = await self.ranks[0].rendezvous.remote()
        heads = await asyncio.wait_for(asyncio.gather(*[
            r.init_group.remote(host, port, self.timeout_s, self.lockstep_timeout_s)
            for r in self.ranks]),
            timeout=max(120.0, self.timeout_s))
        # the checkpoint's architecture (a GGUF or HF model's own head counts)
        want = resolve_model_config(self.deployment.model).num_kv_heads // self.tp_size
        if list(heads) != [want] * self.tp_size:
            # senders slice heads [r*h, (r+1)*h) for rank r; any other split would corrupt KV
            raise RuntimeError(f"TP ranks hold {list(heads)} KV heads each, expected {want}")
        await self._read_kv_blocks()
        if self.transfer is not None:
            self._agent_infos = list(await asyncio.gather(
                *[r.enable_transfer.remote(self.transfer) for r in self.ranks]))
        self._book.wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name=f"decode-{self.instance}-rounds")

    async def _read_kv_blocks(self) -> None:
        """The KV blocks the ranks allocated (``decode.kv_blocks``; with 0 on CUDA, every block
        that fits, sized by each rank: actors/device.py): the least over the TP ranks, since a
        request holds the same blocks on every rank."""
        stats = await asyncio.gather(*[r.stats.remote() for r in self.ranks])
        self.kv_blocks = min(s.total_blocks for s in stats)
        self.block_size = stats[0].block_size
        log.info("decode instance %d: %d KV blocks of %d tokens", self.instance,
                 self.kv_blocks, self.block_size)

    @property
    def kv_capacity_tokens(self) -> int:
        """KV token slots of this instance, as its ranks reported them (0 before ``start``)."""
        return self.kv_blocks * self.block_size

    async def agent_infos(self) -> list[AgentInfo]:
        """Each rank's transfer agent, in rank order (senders ``add_peer`` them)."""
        if self.transfer is None:
            raise RuntimeError("this decode instance was started without KV transfer")
        return list(self._agent_infos)

    async def connect_senders(self, peers: dict[int, object]) -> None:
        """Sender actors keyed by sender id; each rank's pump answers them."""
        self._senders.update(peers)
        await asyncio.gather(*[r.connect_senders.remote(dict(peers)) for r in self.ranks])

    # -- requests -------------------------------------------------------------------------
    async def reserve(self, request_id: str, prompt_token_ids, sampling: SamplingParams,
                      generated=(), *, keep: bool = False, prefix_from: str = "",
                      prefix_tokens: int = 0, kv_start: int = 0) -> None:
        """Hold blocks on every rank for a prompt prefilled elsewhere; ``DecodeFull`` if no room.

        ``generated``: output tokens the client already has (resuming a request whose instance
        was lost); the prefill computes their KV with the prompt's, and the outputs go on
        from them (their ``num_tokens`` counts them).

        Prefix caching's decode side (engine/kept_kv.py): ``keep`` keeps the KV once the request
        finishes (``drop_kept`` frees it); ``prefix_from`` is a kept run whose positions
        ``[0, prefix_tokens)`` are copied to this request instead of streamed. ``kv_start``:
        elastic decode's master holds positions from there on (actors/decode/elastic_pool.py)."""
        prompt = compact_tokens(prompt_token_ids)
        generated = tuple(int(t) for t in generated)
        req = self._open(request_id, receiving=True)
        req.num_tokens = len(generated)
        self._book.submit(Reserve(request_id, prompt, sampling, generated, keep=keep,
                                  prefix_from=prefix_from, prefix_tokens=prefix_tokens,
                                  kv_start=kv_start))
        await req.admitted

    async def add(self, request_id: str, prompt_token_ids, sampling: SamplingParams) -> None:
        """Queue a prompt that this instance prefills itself; ``ValueError`` for bad input."""
        prompt = compact_tokens(prompt_token_ids)
        req = self._open(request_id, receiving=False)
        self._book.submit(Add(request_id, prompt, sampling))
        await req.admitted

    def transfer_ready(self, request_id: str) -> bool:
        """Whether every rank reported the request's KV complete (False once it left)."""
        req = self._book.requests.get(request_id)
        return req is not None and len(req.ready_ranks) == self.tp_size

    def commit(self, request_id: str, first_token: int,
               logprob: TokenLogprob | None = None) -> None:
        """The prefill's first token (and its logprobs, when the request asked for them);
        decoding starts once every rank also has the KV. A prefill member that streams KV
        sends the token with it (``FirstToken``): then this is not needed, and a call with
        the same token is a no-op."""
        req = self._book.requests.get(request_id)
        if req is None or req.aborting:
            return   # aborted or failed meanwhile: its stream already says so
        if req.first_token is not None and req.first_token == int(first_token):
            return   # it came with the KV
        if not req.receiving or req.first_token is not None:
            raise ValueError(f"request {request_id!r} is not reserved or was already committed")
        req.first_token = int(first_token)
        req.first_logprob = logprob
        self._book.maybe_commit(request_id, req)

    async def stream(self, request_id: str) -> AsyncIterator[OutputDelta]:
        """Output deltas until a finished one; ``DecodeError`` if the request failed. Leaving
        the loop early aborts the request.

        Deltas that queued up while the consumer was busy leave as one: a consumer that falls
        behind (a loaded event loop, a slow hop) gets fewer, larger items instead of a backlog
        of one-token items, each costing it a full hop."""
        book = self._book
        req = book.requests.get(request_id) or book.ended.pop(request_id, None)
        if req is None:
            raise KeyError(f"no live request {request_id!r} on decode instance {self.instance}")
        finished = False
        error: BaseException | None = None   # taken while merging: raised after the merged delta
        try:
            while True:
                item = error or await req.queue.get()
                error = None
                while isinstance(item, OutputDelta) and not item.finished and not req.queue.empty():
                    nxt = req.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        error = nxt
                        break
                    item = item.merged(nxt)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if book.ended.get(request_id) is req:
                del book.ended[request_id]
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: str = "aborted by the caller") -> None:
        """Abort on every rank and free everything; a no-op for unknown or finished requests."""
        self._book.ended.pop(request_id, None)
        req = self._book.requests.get(request_id)
        if req is None or req.aborting:
            return
        req.aborting = True
        self._book.submit(Abort(request_id, reason))

    def drop_kept(self, run_id: str) -> None:
        """Free a finished run's kept KV on every rank (an abort of it; idempotent)."""
        self._book.submit(Abort(run_id, "dropped from the prefix cache"))

    # -- elastic decode (actors/decode/elastic_pool.py) ------------------------------------
    def submit(self, cmd: Command) -> None:
        """A command for the next round that belongs to no request of this instance's book
        (elastic decode's ``Lead``, ``Hold``, ``Release``)."""
        self._book.submit(cmd)

    def expect_range(self, transfer_id: str) -> None:
        self._book.ranges_ready[transfer_id] = set()

    def range_ready(self, transfer_id: str) -> bool:
        """Whether every rank reported the held range's KV complete."""
        return len(self._book.ranges_ready.get(transfer_id, ())) == self.tp_size

    def forget_range(self, transfer_id: str) -> None:
        self._book.ranges_ready.pop(transfer_id, None)

    def nudge(self) -> None:
        """Run a round soon even with nothing to do (the world's gate wants one)."""
        self._book.wake.set()

    def stats(self) -> EngineStats | None:
        """The last engine stats (rank 0), for the decode router; None before the first round."""
        return self._stats

    async def held(self) -> list:
        """Every rank's ``RankHeld`` (leak checks)."""
        return list(await asyncio.gather(*[r.held.remote() for r in self.ranks]))

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self._book.fail_all(DecodeInstanceLost(f"decode instance {self.instance} shut down"))
        if self.ranks:
            with contextlib.suppress(Exception):   # a dead rank answers at once; a hung one not
                await asyncio.wait_for(asyncio.gather(*[r.shutdown.remote() for r in self.ranks]),
                                       timeout=30.0)
            for r in self.ranks:
                ray.kill(r)
            self.ranks = []
        if self.placement is not None:
            self.placement.remove()
            self.placement = None

    # -- internals ------------------------------------------------------------------------
    def _open(self, request_id: str, *, receiving: bool) -> RequestState:
        if self._restarting:
            raise DecodeInstanceLost(f"decode instance {self.instance} is restarting")
        if self._broken is not None:
            raise DecodeInstanceLost(f"decode instance {self.instance} is broken: {self._broken}")
        if self._loop_task is None:
            raise RuntimeError("call start() first")
        return self._book.open(request_id, receiving=receiving)

    def _busy(self) -> tuple[bool, bool]:
        """(the engines have work to step, some rank still receives KV)."""
        s = self._stats
        schedulable = s is not None and (s.running + s.waiting + s.ready) > 0
        return schedulable, self._book.receiving()

    async def _run(self) -> None:
        book = self._book
        try:
            while True:
                schedulable, receiving = self._busy()
                if not book.commands and not schedulable and not self._gate_wants():
                    # Idle: sleep until a command comes; while KV arrives, wake now and then
                    # to pick up the ranks' ready events. (A gate's nudge before the clear
                    # below is seen by the check above: nothing yields in between.)
                    book.wake.clear()
                    timeout = self.poll_interval_s if receiving else None
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(book.wake.wait(), timeout)
                    if not book.commands and not receiving and not self._gate_wants():
                        continue
                if self.gate is not None:   # every instance of the world steps together
                    await self.gate.turn(self.instance)
                async with self.round_lock:   # KunServe regroups between rounds only
                    cmds = book.take_commands()
                    t0 = time.perf_counter()
                    # one Ray call: rank 0 runs the round on every rank (decode/lockstep.py)
                    replies = await self.ranks[0].round.remote(cmds)
                self._answered_at = time.monotonic()
                if replies[0].step_s:
                    self.round_times.append(time.perf_counter() - t0)
                self.rounds += 1
                self._route(cmds, replies)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a rank died or diverged: fail everything
            log.exception("decode instance %d: round failed", self.instance)
            self._break(exc)

    def _gate_wants(self) -> bool:
        return self.gate is not None and self.gate.wanted

    def _route(self, cmds: list[Command], replies: list[StepReply]) -> None:
        self._stats = replies[0].stats
        if replies[0].step_s:
            self.step_times.append(replies[0].step_s)
        self._book.route(cmds, replies)
