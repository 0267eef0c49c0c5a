"""A decode instance's requests as its driver sees them, and what each round's replies do to them.

``RequestBook`` holds the live requests (``requests``), the ones that ended with their end still
queued for a stream not yet opened (``ended``), and the commands the next round sends to every
rank (``commands``, ``wake`` set when one is added). ``route`` applies one round's replies:
``reserve``/``add`` callers admitted or rejected, output deltas queued to their streams,
transfer failures failing their requests, ranks' ready reports counted until the ``Commit``
can go (``maybe_commit``). The driver (``instance.DecodeInstance``) owns the round loop and the
ranks; this module owns no actor and sends nothing itself.
"""

from __future__ import annotations

import asyncio
import collections

from tetris.actors.decode.messages import (Abort, Add, Command, Commit, DecodeError, DecodeFull,
                                           HolderLost, KVTransferFailed, Reserve, StepReply)
from tetris.engine.request import OutputDelta, TokenLogprob

__all__ = ["RequestBook", "RequestState"]

_MAX_ENDED = 4096   # ended requests kept for a stream not yet opened (see RequestBook.ended)


class RequestState:
    """Driver-side state of one live request."""

    def __init__(self, receiving: bool) -> None:
        # No prompt here: the ranks' engines have it, and outputs leave without it (a long
        # context must not travel with every token; the ingress has its own copy).
        self.num_tokens = 0                # output tokens streamed so far (checks the deltas)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.receiving = receiving          # reserved, not yet committed
        self.ready_ranks: set[int] = set()
        self.first_token: int | None = None
        self.first_logprob: TokenLogprob | None = None
        self.aborting = False
        self.admitted: asyncio.Future = asyncio.get_running_loop().create_future()


class RequestBook:
    def __init__(self, instance: int, tp_size: int) -> None:
        self.instance = instance
        self.tp_size = tp_size
        self.requests: dict[str, RequestState] = {}
        # Requests that ended (finished or failed) with their end still queued for a stream
        # not yet opened: the dispatcher opens it after the commit, and a short request can end
        # in between. Taken by ``stream``/``abort``; bounded in case neither ever comes.
        self.ended: collections.OrderedDict[str, RequestState] = collections.OrderedDict()
        self.commands: list[Command] = []
        self.ranges_ready: dict[str, set[int]] = {}   # elastic decode: held range -> ranks ready
        self.wake: asyncio.Event | None = None

    def open(self, request_id: str, *, receiving: bool) -> RequestState:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already on decode instance {self.instance}")
        req = RequestState(receiving)
        self.requests[request_id] = req
        return req

    def submit(self, cmd: Command) -> None:
        self.commands.append(cmd)
        self.wake.set()

    def take_commands(self) -> list[Command]:
        """The commands for the round about to go (none are left for the next)."""
        cmds, self.commands = self.commands, []
        return cmds

    def receiving(self) -> bool:
        """Some rank still receives KV, or the first token (it comes with the KV), for a
        request."""
        return any(r.receiving and (len(r.ready_ranks) < self.tp_size or r.first_token is None)
                   for r in self.requests.values())

    def maybe_commit(self, request_id: str, req: RequestState) -> None:
        if req.receiving and req.first_token is not None and len(req.ready_ranks) == self.tp_size:
            req.receiving = False
            self.submit(Commit(request_id, req.first_token, req.first_logprob))

    def fail(self, request_id: str, error: BaseException) -> None:
        """Deliver ``error`` to the request's stream and abort it on every rank."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if not req.admitted.done():
            req.admitted.set_exception(error)
        req.queue.put_nowait(error)
        self.keep_ended(request_id, req)
        self.commands.append(Abort(request_id, str(error)))
        self.wake.set()

    def keep_ended(self, request_id: str, req: RequestState) -> None:
        self.ended[request_id] = req
        while len(self.ended) > _MAX_ENDED:
            self.ended.popitem(last=False)

    def fail_all(self, error: BaseException) -> None:
        for request_id in sorted(self.requests):
            req = self.requests.pop(request_id)
            if not req.admitted.done():
                req.admitted.set_exception(error)
            req.queue.put_nowait(error)
            self.keep_ended(request_id, req)   # a stream opened later still gets the error

    # -- one round's replies ------------------------------------------------------------------
    def route(self, cmds: list[Command], replies: list[StepReply]) -> None:
        self._settle(cmds, replies)
        for delta in replies[0].outputs:
            req = self.requests.get(delta.request_id)
            if req is None:
                continue   # failed earlier: its stream already ended with the error
            req.queue.put_nowait(self._output(req, delta))
            if delta.finished:
                self.keep_ended(delta.request_id, self.requests.pop(delta.request_id))
        for reply in replies:
            for f in reply.failed:
                req = self.requests.get(f.request_id)
                if f.holder_lost and req is not None and not req.aborting:
                    self.fail(f.request_id, HolderLost(f"{f.request_id} on decode instance "
                                                       f"{self.instance}: {f.reason}"))
                elif req is not None and req.receiving and not req.aborting:
                    self.fail(f.request_id, KVTransferFailed(
                        f"KV transfer of {f.request_id} failed on TP rank {reply.rank}: {f.reason}"))
            for request_id in reply.ready:
                if request_id in self.ranges_ready:   # a range held for a master elsewhere
                    self.ranges_ready[request_id].add(reply.rank)
                req = self.requests.get(request_id)
                if req is not None and req.receiving:
                    req.ready_ranks.add(reply.rank)
                    self.maybe_commit(request_id, req)
            for first in reply.first_tokens:
                req = self.requests.get(first.request_id)
                if req is not None and req.receiving and req.first_token is None:
                    req.first_token, req.first_logprob = first.token, first.logprob
                    self.maybe_commit(first.request_id, req)

    @staticmethod
    def _output(req: RequestState, delta: OutputDelta) -> OutputDelta:
        req.num_tokens += len(delta.new_token_ids)
        if req.num_tokens != delta.num_tokens:
            raise RuntimeError(f"{delta.request_id}: {req.num_tokens} tokens streamed but the "
                               f"engine has {delta.num_tokens} (a step's output was lost)")
        return delta

    def _settle(self, cmds: list[Command], replies: list[StepReply]) -> None:
        """Answer ``reserve``/``add`` callers: admitted, or rejected (same on every rank)."""
        rejected = {}
        for reply in replies:
            for rej in reply.rejected:
                rejected.setdefault(rej.request_id, rej)
        for cmd in cmds:
            if isinstance(cmd, Commit) and cmd.request_id in rejected:
                self.fail(cmd.request_id, DecodeError(
                    f"commit of {cmd.request_id} refused: {rejected[cmd.request_id].reason}"))
            if not isinstance(cmd, (Reserve, Add)):
                continue
            req = self.requests.get(cmd.request_id)
            if req is None:
                continue
            rej = rejected.get(cmd.request_id)
            if rej is None:
                if not req.admitted.done():
                    req.admitted.set_result(None)
                continue
            del self.requests[cmd.request_id]
            if rej.full:
                err: Exception = DecodeFull(f"decode instance {self.instance}: {rej.reason}")
            else:
                err = ValueError(rej.reason)
            req.admitted.set_exception(err)
            if any(not any(r.request_id == cmd.request_id for r in reply.rejected) for reply in replies):
                # Ranks disagreed (they should not): undo it where it was applied.
                self.commands.append(Abort(cmd.request_id, "rejected on another TP rank"))
