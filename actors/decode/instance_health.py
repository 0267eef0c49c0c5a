"""A decode instance's health, mixed into ``DecodeInstance``: broken, checked, restarted.

A round that fails (a rank died or diverged) breaks the instance: every request it holds
fails with ``DecodeInstanceLost`` and the dispatcher runs them again elsewhere. ``check``
finds a rank that died while the instance was idle (no rounds to notice it); ``restart``
replaces every rank and reconnects the senders.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import ray

from tetris.actors.decode.messages import DecodeInstanceLost

__all__ = ["InstanceHealth"]

_ALIVE_FRESH_S = 1.0   # a round answered this recently proves every rank alive (``check``)


class InstanceHealth:
    """Mixed into ``DecodeInstance``: why it stopped serving, and bringing it back."""

    rebuilds = 0   # times it served again with its ranks rebuilt in place (``resume_rounds``)

    @property
    def broken(self) -> BaseException | None:
        """Why the instance stopped serving (a round failed: a rank died or diverged), or None."""
        return self._broken

    @property
    def serving(self) -> bool:
        """Neither broken nor restarting (its rank actors take rounds)."""
        return self._broken is None and not self._restarting and bool(self.ranks)

    async def check(self, timeout_s: float = 10.0) -> BaseException | None:
        """``broken``, after making sure every rank is still alive: an idle instance sends no
        rounds, so a rank that died meanwhile would otherwise fail the next request first. Every
        rank answering a round proves it alive, so a busy instance is not pinged. A rank too
        busy to answer within ``timeout_s`` counts as alive."""
        fresh = time.monotonic() - self._answered_at < _ALIVE_FRESH_S
        if self._broken is None and self.ranks and not self._restarting and not fresh:
            try:
                await asyncio.wait_for(asyncio.gather(
                    *[r.__ray_ready__.remote() for r in self.ranks]), timeout_s)
            except ray.exceptions.RayActorError as e:
                self._break(e)
            except TimeoutError:   # asyncio.TimeoutError is TimeoutError (3.11)
                pass
        return self._broken

    async def restart(self, senders: dict[int, object] | None = None) -> None:
        """Replace every rank: new actors, TP group, engines and transfer agents, connected to
        the senders it had, updated by ``senders`` (sender id -> actor; a replaced prefill
        worker is a new actor). The requests it held have already failed (``DecodeError``).
        Senders must ``add_peer`` the new ``agent_infos`` (same names, new addresses) before
        they can stream to it again; until this returns, new requests are refused."""
        self._restarting = True
        try:
            await self.shutdown()
            self._broken = None
            self._answered_at = -math.inf
            self._book.commands.clear()
            self._stats = None
            await self.start()
            if self._senders or senders:
                await self.connect_senders({**self._senders, **(senders or {})})
            self.restarts += 1
        except BaseException as e:
            self._broken = e if isinstance(e, Exception) else RuntimeError("restart cancelled")
            raise
        finally:
            self._restarting = False

    def note_stats(self, stats) -> None:
        """Engine stats read outside a round: a KunServe drop or restore changed the engine's
        blocks while no round ran, and the router reads free blocks from the last stats (an
        idle instance runs no round to correct them)."""
        self._stats = stats

    async def resume_rounds(self) -> None:
        """Serve again with the same rank actors, rebuilt in place (a KunServe group's
        survivor: ``rank_kunserve.kunserve_rebuild``), without a restart. The requests it held
        have already failed (``DecodeInstanceLost``)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._broken = None
        self._answered_at = -math.inf
        self._book.commands.clear()
        await self._read_kv_blocks()
        self._stats = await self.ranks[0].stats.remote()   # the rebuilt engine's, for routing
        self._book.wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name=f"decode-{self.instance}-rounds")
        self.rebuilds += 1

    def _break(self, exc: BaseException) -> None:
        """Stop serving: fail every request it holds; ``restart`` brings it back."""
        if self._broken is not None:
            return
        self._broken = exc
        self._book.fail_all(DecodeInstanceLost(f"decode instance {self.instance} failed: {exc}"))
        if self._loop_task is not None and self._loop_task is not asyncio.current_task():
            self._loop_task.cancel()   # found by ``check``: no more rounds to dead ranks
