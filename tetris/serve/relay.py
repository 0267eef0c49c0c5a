"""Tokens go from the decode instance to the ingress in one hop; the dispatcher hears of the
stream's two events that concern it, not of each token.

Lifecycle of one run's decode stream when the dispatcher relays (the Ray Serve app):

1. the dispatcher commits the first token to the decode instance and yields a
   ``DecodeHandoff`` (which instance, which run, how much of the stream the client already
   has) instead of streaming the outputs itself; it then waits for the run's reports;
2. the ingress (``follow``) opens the decode pool's stream of that run directly, trims what
   the client already has (``StreamCursor``) and forwards every output;
3. at the first output it reports ``kv_arrived`` (the KV is on the decode instance: the
   prefill side may free its copy), without waiting for the answer;
4. when the stream ends it reports how: ``finished``, ``lost`` (an ``InstanceLost``: the
   dispatcher runs the request again from the tokens the client has, and hands off anew) or
   ``failed``; each with the output tokens and characters this run gave the client;
5. a client that leaves closes both streams; the dispatcher's cleanup aborts the run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

import msgspec

from tetris.engine.request import OutputDelta
from tetris.errors import InstanceLost
from tetris.serve.first_token import StreamCursor

__all__ = ["DecodeHandoff", "RelayReport", "RelayBoxes", "follow"]


class DecodeHandoff(msgspec.Struct, frozen=True):
    """Stream run ``run_id`` of request ``request_id`` from decode ``instance``; the client
    already has ``ids_sent`` output tokens and ``chars_sent`` characters of it."""

    request_id: str
    run_id: str
    instance: int
    ids_sent: int = 0
    chars_sent: int = 0
    cached_tokens: int = 0   # prefix-cache hit, told on the first output (dispatcher's note)


class RelayReport(msgspec.Struct, frozen=True):
    """What the ingress tells the dispatcher of a relayed run."""

    kind: Literal["kv_arrived", "finished", "lost", "failed"]
    token_ids: tuple[int, ...] = ()   # output tokens this run gave the client
    chars: int = 0                    # characters this run gave the client
    num_tokens: int = 0               # the decode stream's own count at its end
    finish_reason: str | None = None
    error: str = ""


class RelayBoxes:
    """The dispatcher's mailboxes, one per relayed run; reports for unknown runs are dropped
    (the run was aborted and freed meanwhile)."""

    def __init__(self) -> None:
        self._boxes: dict[str, asyncio.Queue[RelayReport]] = {}

    def open(self, run_id: str) -> asyncio.Queue[RelayReport]:
        return self._boxes.setdefault(run_id, asyncio.Queue())

    def deliver(self, run_id: str, report: RelayReport) -> bool:
        box = self._boxes.get(run_id)
        if box is None:
            return False
        box.put_nowait(report)
        return True

    def close(self, run_id: str) -> None:
        self._boxes.pop(run_id, None)

    def __len__(self) -> int:
        return len(self._boxes)


Report = Callable[[str, RelayReport], Awaitable[None]]


async def follow(dispatched: AsyncIterator, stream: Callable[[int, str], AsyncIterator],
                 report: Report) -> AsyncIterator[OutputDelta]:
    """The client's stream: the dispatcher's outputs, with each ``DecodeHandoff`` replaced by
    the decode instance's own stream of that run. ``stream(instance, run_id)`` opens a decode
    stream; ``report(run_id, RelayReport)`` reaches the dispatcher."""
    pending: set[asyncio.Task] = set()
    try:
        async for item in dispatched:
            if not isinstance(item, DecodeHandoff):
                yield item
                continue
            async for out in _relay(item, stream, report, pending):
                yield out
    finally:
        for task in list(pending):   # a kv_arrived report still in flight
            with contextlib.suppress(BaseException):
                await task
        close = getattr(dispatched, "aclose", None)   # a client that left ends the run too
        if close is not None:
            await close()


async def _relay(h: DecodeHandoff, stream, report: Report,
                 pending: set[asyncio.Task]) -> AsyncIterator[OutputDelta]:
    cursor = StreamCursor(h.ids_sent, h.chars_sent)
    ids: list[int] = []
    chars, num_tokens, first = 0, 0, True
    end = RelayReport("failed", error="the decode stream ended without a final output")
    try:
        async with contextlib.aclosing(stream(h.instance, h.run_id)) as outs:
            async for out in outs:
                if first:
                    first = False
                    task = asyncio.ensure_future(report(h.run_id, RelayReport("kv_arrived")))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                num_tokens = out.num_tokens
                if (out := cursor.follow(out)) is None:
                    continue
                if out.request_id != h.request_id:   # under the client's id, whichever run
                    out = msgspec.structs.replace(out, request_id=h.request_id)
                if h.cached_tokens and not ids and not chars:
                    out = msgspec.structs.replace(out, cached_tokens=h.cached_tokens)
                ids.extend(out.new_token_ids)
                chars += len(out.new_text)
                yield out
                if out.finished:
                    end = RelayReport("finished", finish_reason=out.finish_reason)
                    break
    except InstanceLost as e:
        end = RelayReport("lost", error=str(e) or type(e).__name__)
    except (GeneratorExit, asyncio.CancelledError):
        raise   # the client left: the dispatcher's cleanup aborts the run
    except Exception as e:  # noqa: BLE001 - reported, the dispatcher fails the request
        end = RelayReport("failed", error=f"{type(e).__name__}: {e}")
    await report(h.run_id, msgspec.structs.replace(
        end, token_ids=tuple(ids), chars=chars, num_tokens=num_tokens))
