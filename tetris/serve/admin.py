"""Admin routes of the ingress: read and replace the θ table and the latency profile, and look
at recent plans, per-request timelines and what is still held (operators and tests).

    GET  /admin/rate_table          {"rates": [...], "improvement_rates": [...], ...}
    PUT  /admin/rate_table          same keys; the rate monitor uses it from its next update
    GET  /admin/latency_profile     the prefill latency profile (coefficients per SP size)
    PUT  /admin/latency_profile     a profile; the policy is rebuilt on it
    POST /admin/drain               {"instances": [0, 1], "seconds": 30}: plan no new work on
                                    them for that long (running work goes on)
    GET  /admin/plans               the last 64 prefill plans
    GET  /admin/timelines?last=N    per-request TTFT breakdowns (queue, prefill, hand-off)
    GET  /admin/prefix_cache        the prefix index (blocks, hits, queries); DELETE clears it
    GET  /admin/held                reservations still held (queue time, virtual usage,
                                    prefill KV and shards, decode blocks): zero when idle

A bad table or profile is refused with a 400 OpenAI-style error body and changes nothing.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from tetris.serve.protocol import ProtocolError

__all__ = ["add_admin_routes"]


def add_admin_routes(app: FastAPI, dispatcher) -> None:
    """``dispatcher``: the dispatcher deployment's handle."""

    async def body(request: Request) -> dict:
        try:
            data = await request.json()
        except ValueError as e:
            raise ProtocolError(f"malformed JSON body: {e}") from None
        if not isinstance(data, dict):
            raise ProtocolError("the body must be a JSON object")
        return data

    async def call(method, *args):
        try:
            return await method.remote(*args)
        except ValueError as e:   # RateTableError, ProfileError, msgspec validation
            raise ProtocolError(str(e).strip().splitlines()[-1]) from None

    @app.get("/admin/rate_table")
    async def get_rate_table():
        return await call(dispatcher.rate_table)

    @app.put("/admin/rate_table")
    async def put_rate_table(request: Request):
        return await call(dispatcher.rate_table, await body(request))

    @app.get("/admin/latency_profile")
    async def get_profile():
        return await call(dispatcher.latency_profile)

    @app.put("/admin/latency_profile")
    async def put_profile(request: Request):
        return await call(dispatcher.latency_profile, await body(request))

    @app.post("/admin/drain")
    async def drain(request: Request):
        data = await body(request)
        instances, seconds = data.get("instances"), data.get("seconds")
        if not isinstance(instances, list) or not isinstance(seconds, (int, float)):
            raise ProtocolError("expected {\"instances\": [...], \"seconds\": N}")
        return await call(dispatcher.drain, instances, float(seconds))

    @app.get("/admin/plans")
    async def plans():
        return await dispatcher.plans.remote()

    @app.get("/admin/timelines")
    async def timelines(last: int = 100):
        return await dispatcher.timelines.remote(last)

    @app.get("/admin/held")
    async def held():
        return await dispatcher.held.remote()

    @app.get("/admin/prefix_cache")
    async def prefix_cache():
        return await dispatcher.prefix_cache.remote()

    @app.delete("/admin/prefix_cache")
    async def clear_prefix_cache():
        return await dispatcher.prefix_cache.remote(True)
