"""One OpenAI request, many generations: ``n`` samples of each of its prompts, concurrently.

``start_all`` starts every choice's generation and waits for each one's first output, so a
refusal of any (429 when overloaded, 400) is the request's status and nothing of it runs on:
the choices already started are closed, which aborts them. ``merged`` then interleaves the
choices' outputs in arrival order; leaving it early (client gone) closes every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from tetris.engine.request import OutputDelta

__all__ = ["start_all", "merged"]

Stream = AsyncIterator[OutputDelta]


async def start_all(starts: Sequence[Callable[[], Awaitable[tuple[Stream, OutputDelta]]]]
                    ) -> list[tuple[Stream, OutputDelta]]:
    """Run every ``start()`` (each returns a stream and its first output) concurrently; if one
    fails, close the streams of the others and raise its error (the first in order)."""
    if len(starts) == 1:
        return [await starts[0]()]
    results = await asyncio.gather(*(s() for s in starts), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if not isinstance(r, BaseException):
                await r[0].aclose()
        raise failed[0]
    return list(results)


async def merged(started: Sequence[tuple[Stream, OutputDelta]]
                 ) -> AsyncIterator[tuple[int, OutputDelta]]:
    """(choice, output) pairs: every first output, then the rest as they come."""
    for i, (_, first) in enumerate(started):
        yield i, first
    live = [(i, stream) for i, (stream, first) in enumerate(started) if not first.finished]
    if len(live) == 1:   # no tasks for the common case
        i, stream = live[0]
        async for out in stream:
            yield i, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: Stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in live]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        for _, stream in live:
            await stream.aclose()
