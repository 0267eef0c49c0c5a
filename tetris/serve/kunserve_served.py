"""KunServe in the served app (issue #24): the decode pool's driver, its overload hook, the
admin routes on the ingress.

``KunServePool`` is mixed into ``DecodePoolServer``. With ``[kunserve] enabled``, ``start``
builds a ``ServedKunServe`` (``actors/decode/kunserve_group.py``) over the pool's instances
and a monitor task: every ``monitor_s`` one controller tick, so that a group is restored once
demand fell (§4.4), and a group with a broken member is let go, its live members rebuilt in
place (``ServedKunServe.rebuild_after_loss``; also before the pool reports its health and
before the supervisor restarts the dead member). When an instance refuses a
reservation for want of KV (``DecodeFull``, the dispatcher's 429), the controller first ticks
with that request's blocks as queued demand: its overload decision drops layers on a group,
whose running requests then grow into the freed memory instead of being preempted, and, with
``[kunserve] landing_blocks``, the request is reserved again on its now dropped instance (its
KV lands whole and is forwarded layer by layer: ``actors/decode/landing.py``). Without a
landing zone a dropped member takes no prefilled KV, and the refusal stays a 429.

``add_kunserve_served_routes(app, decode)`` mounts, over the pool's handle:

    GET  /admin/kunserve          groups, layer ranges, KV blocks per unit, dropped layers,
                                  instances rebuilt in place, restarts, each member's rank
    POST /admin/kunserve/drop     {"groups": [[0, 1]]} (optionally "layer_ranges"): forced
    POST /admin/kunserve/restore  {"leader": 0}
    GET  /metrics/kunserve        ``tetris:dropped_layers{instance}`` and the KV capacity

A refused drop or restore (a layer's last copy lost, an unknown or grouped instance, requests
that would not fit) answers 400 and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tetris.control.drop_plan import DropRefused
from tetris.serve.kunserve_admin import _groups, kunserve_metrics, kunserve_view

__all__ = ["KunServePool", "add_kunserve_served_routes"]

log = logging.getLogger(__name__)


class KunServePool:
    """Mixed into ``DecodePoolServer`` (its ``instances``)."""

    kunserve = None            # ServedKunServe once started with [kunserve] enabled
    _kunserve_task: asyncio.Task | None = None

    async def _start_kunserve(self, config) -> None:
        """``config``: the deployment's ``KunServeConfig``."""
        from tetris.actors.decode.kunserve_group import ServedKunServe

        self.kunserve = ServedKunServe(self.instances, landing_blocks=config.landing_blocks,
                                       lookahead_overhead_seqs=config.member_lookahead())
        await self.kunserve.start()
        self._kunserve_task = asyncio.create_task(self._kunserve_monitor(config.monitor_s),
                                                  name="kunserve-monitor")

    async def _kunserve_monitor(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)   # the monitor's period, not a synchronisation
            try:
                await self.kunserve.rebuild_after_loss()
                if any(g.size > 1 for g in self.kunserve.controller.groups):
                    await self.kunserve.tick()
            except Exception:
                log.exception("KunServe monitor tick failed")

    async def _reserve_or_tick(self, instance: int, reserve, kv_tokens: int) -> None:
        """``await reserve()``; on ``DecodeFull`` the controller decides first, with the
        ``kv_tokens`` the request needs as queued demand, and when it dropped ``instance``
        into a group that lands prefilled prompts, the reservation is tried once more there
        (instead of the 429)."""
        from tetris.actors.decode.messages import DecodeFull

        try:
            return await reserve()
        except DecodeFull as full:
            if self.kunserve is None:
                raise
            blocks = -(-(kv_tokens + 1) // self.instances[instance].block_size)
            refusals = len(self.kunserve.controller.refusals)
            try:
                decision = await self.kunserve.tick({instance: blocks}, fit_blocks=blocks)
            except Exception:
                log.exception("KunServe tick on a refused reservation failed")
                raise full from None
            if decision != "drop" or not self.kunserve.landing_blocks or \
                    self.kunserve.dropped_layers().get(instance, 0) == 0:
                for why in self.kunserve.controller.refusals[refusals:]:
                    log.warning("KunServe: no drop for a request of %d blocks (429): %s",
                                blocks, why)
                raise
        await reserve()   # dropped now, with a landing zone: once more

    async def _kunserve_rebuild(self) -> list[int]:
        """A group with a broken member is let go, its live members rebuilt in place (before
        health is reported and before a broken instance restarts): the instances rebuilt."""
        if self.kunserve is None:
            return []
        return await self.kunserve.rebuild_after_loss()

    async def kunserve_state(self) -> dict:
        if self.kunserve is None:
            return {"enabled": False}
        kun = self.kunserve
        return {"enabled": True} | kunserve_view(kun) | {
            "rebuilt_in_place": list(kun.rebuilt), "lost_requests": kun.lost_requests,
            "restarts": [inst.restarts for inst in self.instances],
            "members": await self._member_states()}

    async def _member_states(self) -> list[dict | str]:
        """Each instance's rank as a KunServe member: layers held, blocks and, while dropped,
        the pipeline's counters (steps, stage runs, prompt tokens computed); why not, for an
        instance that cannot answer (broken, restarting)."""
        async def one(inst):
            if inst.broken is not None or not inst.ranks:
                return f"unavailable: {inst.broken}"
            try:
                return await asyncio.wait_for(inst.ranks[0].kunserve_state.remote(), 10.0)
            except Exception as e:  # noqa: BLE001 - a view, not an action
                return f"unavailable: {type(e).__name__}"
        return list(await asyncio.gather(*[one(inst) for inst in self.instances]))

    async def kunserve_drop(self, body: dict) -> dict:
        """A forced drop; ``{"error": ...}`` (nothing changed) when refused."""
        if self.kunserve is None:
            return {"error": "KunServe is not enabled ([kunserve] enabled = true)"}
        try:
            groups = _groups(body, self.kunserve.controller.mem.num_layers)
            await self.kunserve.force_drop(groups)
        except (DropRefused, ValueError, TypeError) as e:
            return {"error": str(e)}
        return await self.kunserve_state()

    async def kunserve_restore(self, leader: int) -> dict:
        if self.kunserve is None:
            return {"error": "KunServe is not enabled ([kunserve] enabled = true)"}
        try:
            await self.kunserve.force_restore(int(leader))
        except (DropRefused, ValueError, TypeError) as e:
            return {"error": str(e)}
        return await self.kunserve_state()

    async def kunserve_metrics(self) -> bytes:
        return b"" if self.kunserve is None else kunserve_metrics(self.kunserve)


def add_kunserve_served_routes(app: FastAPI, decode) -> None:
    """``decode``: the decode pool's handle (its ``KunServePool`` methods)."""

    async def body(request: Request) -> dict | None:
        try:
            data = await request.json()
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def answer(result: dict):
        if "error" in result:
            return JSONResponse({"error": {"message": result["error"],
                                           "type": "invalid_request_error"}}, status_code=400)
        return result

    @app.get("/admin/kunserve")
    async def view():
        return await decode.kunserve_state.remote()

    @app.post("/admin/kunserve/drop")
    async def drop(request: Request):
        data = await body(request)
        if data is None:
            return answer({"error": "the body must be a JSON object"})
        return answer(await decode.kunserve_drop.remote(data))

    @app.post("/admin/kunserve/restore")
    async def restore(request: Request):
        data = await body(request)
        if data is None or not isinstance(data.get("leader"), int):
            return answer({"error": 'expected {"leader": N}'})
        return answer(await decode.kunserve_restore.remote(data["leader"]))

    @app.get("/metrics/kunserve")
    async def metrics():
        return Response(await decode.kunserve_metrics.remote(),
                        media_type="text/plain; version=0.0.4")
