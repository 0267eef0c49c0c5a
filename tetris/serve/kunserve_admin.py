"""KunServe's operator surface: its metrics and admin routes, over any driver of the controller.

    GET  /admin/kunserve          groups (members, layer ranges, KV blocks), dropped layers per
                                  instance, drops / restores / refusals, KV exchanged
    POST /admin/kunserve/drop     {"groups": [[0, 1], [2, 3, 4]]} (layer ranges split evenly,
                                  or "layer_ranges": [[[0, 24], [24, 48]], ...]): a forced drop
    POST /admin/kunserve/restore  {"leader": 0}: split that group back into replicas
    GET  /metrics/kunserve        Prometheus text: ``tetris:dropped_layers{instance}``,
                                  ``tetris:kunserve_kv_capacity_blocks{unit}``,
                                  ``tetris:kunserve_exchange_bytes``

A driver is what applies the controller's grouping to engines (the EMULATION's
``KunServeEmulation``): it has ``controller`` (a ``KunServeController``), ``lock`` (held
around the controller's changes, which its own monitor makes too), ``regroup()`` (make the
engines match ``controller.groups``), ``unit_blocks()`` (KV blocks of each unit now, by
leader) and ``exchange_bytes``. A refused drop or restore answers 400 and changes nothing.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from tetris.control.drop_plan import DropRefused, Group, split_layers

__all__ = ["add_kunserve_routes", "kunserve_metrics", "kunserve_view"]


def kunserve_view(driver) -> dict:
    c = driver.controller
    blocks = driver.unit_blocks()
    return {"groups": [{"members": list(g.members),
                        "layer_ranges": [list(r) for r in g.layer_ranges],
                        "kv_blocks": blocks.get(g.members[0])} for g in c.groups],
            "dropped_layers": {str(i): n for i, n in c.dropped_layers().items()},
            "drops": c.drops, "restores": c.restores, "refusals": list(c.refusals),
            "exchange_bytes": driver.exchange_bytes}


def kunserve_metrics(driver) -> bytes:
    """The metrics now, in a registry of their own (rendered per scrape: the grouping is the
    controller's state, not a stream of events)."""
    reg = CollectorRegistry(auto_describe=True)
    dropped = Gauge("tetris:dropped_layers", "Decoder layers this instance does not hold "
                    "(KunServe drop).", ["instance"], registry=reg)
    capacity = Gauge("tetris:kunserve_kv_capacity_blocks", "KV blocks a serving unit (an "
                     "instance or a group, by leader) can give requests.", ["unit"], registry=reg)
    exchanged = Gauge("tetris:kunserve_exchange_bytes", "KV bytes moved by drops and restores.",
                      registry=reg)
    for i, n in driver.controller.dropped_layers().items():
        dropped.labels(str(i)).set(n)
    for leader, n in sorted(driver.unit_blocks().items()):
        capacity.labels(str(leader)).set(n)
    exchanged.set(driver.exchange_bytes)
    return generate_latest(reg)


def _groups(data: dict, num_layers: int) -> list[Group]:
    members = data.get("groups")
    if not isinstance(members, list) or not all(isinstance(m, list) and m for m in members):
        raise DropRefused('"groups" must be a list of non-empty lists of instance ids')
    ranges = data.get("layer_ranges") or [split_layers(num_layers, len(m)) for m in members]
    if len(ranges) != len(members):
        raise DropRefused('"layer_ranges" needs one list of ranges per group')
    return [Group(tuple(int(i) for i in m), tuple((int(s), int(e)) for s, e in r))
            for m, r in zip(members, ranges, strict=True)]


def add_kunserve_routes(app: FastAPI, driver) -> None:
    async def body(request: Request) -> dict:
        try:
            data = await request.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise DropRefused("the body must be a JSON object")
        return data

    def refused(e: Exception) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}},
                            status_code=400)

    @app.get("/admin/kunserve")
    async def view():
        return kunserve_view(driver)

    @app.post("/admin/kunserve/drop")
    async def drop(request: Request):
        try:
            groups = _groups(await body(request), driver.controller.mem.num_layers)
            with driver.lock:
                driver.controller.force_drop(groups)
        except (DropRefused, ValueError, TypeError) as e:
            return refused(e)
        driver.regroup()
        return kunserve_view(driver)

    @app.post("/admin/kunserve/restore")
    async def restore(request: Request):
        try:
            leader = int((await body(request)).get("leader", -1))
            with driver.lock:
                driver.controller.force_restore(leader)
        except (DropRefused, ValueError, TypeError) as e:
            return refused(e)
        driver.regroup()
        return kunserve_view(driver)

    @app.get("/metrics/kunserve")
    async def metrics():
        return Response(kunserve_metrics(driver), media_type="text/plain; version=0.0.4")
