"""What a served app still holds, read from ``/admin/held``: the idle check the HTTP tests of
the Ray-served app (elastic decode, KunServe) end with."""

from __future__ import annotations

import json
import time

import httpx


def idle(held: dict) -> bool:
    """Nothing in flight, booked, reserved or relayed, no run on a prefill worker, every
    decode rank empty."""
    d = held["dispatcher"]
    return (d["inflight"] == d["queue_bookings"] == d["virtual_usage"] == 0
            and d["cleanups"] == 0 and d["relayed"] == 0 and not any(held["prefill"].values())
            and all(rank["empty"] for inst in held["decode"] for rank in inst["ranks"]))


def assert_idle_soon(base: str, timeout_s: float = 30.0) -> None:
    """The app at ``base`` is idle within ``timeout_s`` (cleanups finish asynchronously)."""
    deadline = time.monotonic() + timeout_s
    held = httpx.get(f"{base}/admin/held", timeout=60).json()
    while not idle(held) and time.monotonic() < deadline:
        time.sleep(0.2)
        held = httpx.get(f"{base}/admin/held", timeout=60).json()
    assert idle(held), json.dumps(held, indent=1)
