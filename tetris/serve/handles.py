"""The dispatcher's clients of the two pool deployments, over Serve handles.

Each call crosses a process boundary; what a pool raised comes back through
``tetris.serve.remote_errors`` as what the dispatcher acts on: ``InstanceLost`` (run the
request again), ``InstanceReplacing`` (plan again) or ``Overloaded`` (refuse, retry later).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from tetris.serve.backend import Overloaded
from tetris.serve.remote_errors import as_lost, as_replacing, carried

__all__ = ["PrefillHandleClient", "DecodeHandleClient"]


class PrefillHandleClient:
    """``PrefillClient`` over the prefill pool deployment's handle."""

    def __init__(self, handle) -> None:
        self.h = handle

    async def commit(self, plan, wait_replacing: bool = False) -> list[float]:
        try:
            return await self.h.commit.remote(plan, wait_replacing)
        except Exception as e:
            raise as_replacing(e) from None

    async def busy_for(self) -> list[float]:
        return await self.h.busy_for.remote()

    async def run(self, plan, token_ids, sampling, kv_receivers, **prefix):
        try:
            return await self.h.run.remote(plan, token_ids, sampling, kv_receivers, **prefix)
        except Exception as e:
            raise as_lost(e) from None

    async def release(self, request_id: str) -> None:
        await self.h.release.remote(request_id)

    async def abort(self, request_id: str) -> None:
        await self.h.abort.remote(request_id)


class DecodeHandleClient:
    """``DecodeClient`` over the decode pool deployment's handle."""

    def __init__(self, handle, receivers: list[tuple[int, ...]]) -> None:
        self.h = handle
        self.receivers = receivers

    def receiver_ids(self, instance: int) -> tuple[int, ...]:
        return self.receivers[instance]

    async def reserve(self, instance, request_id, prompt, sampling, generated=(), **prefix) -> None:
        try:
            await self.h.reserve.remote(instance, request_id, prompt, sampling, generated, **prefix)
        except Exception as e:
            _refused(e, instance)
            raise

    async def commit(self, instance, request_id, first_token, logprob=None) -> None:
        try:
            await self.h.commit.remote(instance, request_id, first_token, logprob)
        except Exception as e:
            raise as_lost(e) from None

    # elastic decode (tetris/serve/elastic_dispatch.py): ranges are (instance, start, end)
    async def elastic_place(self, request_id, prompt, sampling, ranges, generated=()) -> None:
        try:
            await self.h.elastic_place.remote(request_id, prompt, sampling, ranges, generated)
        except Exception as e:
            _refused(e, ranges[-1][0])
            raise

    async def elastic_commit(self, request_id, ranges, first_token, logprob=None) -> None:
        try:
            await self.h.elastic_commit.remote(request_id, ranges, first_token, logprob)
        except Exception as e:
            raise as_lost(e) from None

    async def elastic_release(self, request_id, ranges) -> None:
        await self.h.elastic_release.remote(request_id, ranges)

    async def stream(self, instance, request_id) -> AsyncIterator:
        gen = self.h.options(stream=True).stream.remote(instance, request_id)
        try:
            async for out in gen:
                yield out
        except Exception as e:
            raise as_lost(e) from None
        finally:
            gen.cancel()

    async def abort(self, instance, request_id) -> None:
        await self.h.abort.remote(instance, request_id)

    async def drop_kept(self, instance, run_id) -> None:
        await self.h.drop_kept.remote(instance, run_id)

    async def stats(self) -> list:
        return await self.h.stats.remote()


def _refused(e: BaseException, instance: int) -> None:
    """A reservation's refusal as ``Overloaded`` (no KV room, or an instance being healed)."""
    from tetris.actors.decode.instance import DecodeError, DecodeFull

    if (full := carried(e, DecodeFull)) is not None:
        raise Overloaded(f"decode instance {instance} has no KV room: {full}",
                         retry_after_s=getattr(full, "retry_after_s", 1.0)) from None
    if (broken := carried(e, DecodeError)) is not None:   # the dispatcher heals it
        raise Overloaded(f"decode instance {instance} is unavailable: {broken}",
                         retry_after_s=2.0) from None
