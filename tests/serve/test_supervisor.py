"""The supervisor's decode rounds back off while nothing is in flight (no Ray: fake handles)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tetris.serve import supervisor as sup


class _Remote:
    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def remote(self, *args):
        self.calls += 1

        async def call():
            return self.fn(*args)
        return call()


class _Dispatcher:
    def __init__(self) -> None:
        self.running = 0
        self.refreshes = 0
        self.control = SimpleNamespace(router=SimpleNamespace(down=set()))

    def stats(self) -> dict:
        return {"running": self.running}

    async def refresh_decode_load(self):
        self.refreshes += 1
        return [None]


def test_decode_rounds_back_off_while_idle_and_resume_with_a_request(monkeypatch):
    # An idle server ran a decode round (two Serve calls and a ping to every decode rank)
    # every 0.5 s; now the rounds double their period up to IDLE_POLL_S while nothing is in
    # flight, and run every tick again as soon as a request is.
    monkeypatch.setattr(sup, "POLL_S", 0.01)
    monkeypatch.setattr(sup, "IDLE_POLL_S", 0.16)
    d = _Dispatcher()
    decode = SimpleNamespace(health=_Remote(lambda: [None]))
    prefill = SimpleNamespace(heal=_Remote(lambda: []))
    metrics = SimpleNamespace(set_kv_usage=lambda i, v: None)
    s = sup.Supervisor(d, metrics, prefill, decode, prefill_check_s=0.05)

    async def scenario():
        s.start()
        await asyncio.sleep(1.0)
        idle = d.refreshes
        d.running = 1
        await asyncio.sleep(0.02)
        woke = d.refreshes
        await asyncio.sleep(0.5)
        busy = d.refreshes - woke
        d.running = 0
        await asyncio.sleep(0.3)
        s._task.cancel()
        return idle, woke, busy

    idle, woke, busy = asyncio.run(scenario())
    # 1 s idle: rounds at 0, .02, .06, .14, .30, .46, ... (every 0.16 s once backed off)
    assert 4 <= idle <= 10, idle
    assert woke > idle                       # the first request in flight: a round at once
    assert busy >= 20, busy                  # then one a tick (0.01 s; loaded machines are slow)
    assert decode.health.calls == d.refreshes
    assert prefill.heal.calls >= 6           # the prefill probe keeps its own period


def test_prefill_probe_backs_off_while_idle_and_resumes_with_a_request(monkeypatch):
    # The prefill probe (a Serve call and a ping to every prefill worker) ran every
    # prefill_check_s even on an idle server; now its period doubles up to
    # IDLE_PREFILL_CHECK_S while nothing is in flight and is prefill_check_s again within a
    # tick of a request.
    monkeypatch.setattr(sup, "POLL_S", 0.01)
    monkeypatch.setattr(sup, "IDLE_POLL_S", 0.16)
    monkeypatch.setattr(sup, "IDLE_PREFILL_CHECK_S", 0.4)
    d = _Dispatcher()
    decode = SimpleNamespace(health=_Remote(lambda: [None]))
    prefill = SimpleNamespace(heal=_Remote(list))
    metrics = SimpleNamespace(set_kv_usage=lambda i, v: None)
    s = sup.Supervisor(d, metrics, prefill, decode, prefill_check_s=0.05)

    async def scenario():
        s.start()
        await asyncio.sleep(1.2)
        idle = prefill.heal.calls
        d.running = 1
        await asyncio.sleep(0.04)
        woke = prefill.heal.calls
        await asyncio.sleep(0.6)
        busy = prefill.heal.calls - woke
        d.running = 0
        s._task.cancel()
        return idle, woke, busy

    idle, woke, busy = asyncio.run(scenario())
    # 1.2 s idle: probes at 0, .05, .15, .35, .75 (then every 0.4 s): 5, where a fixed
    # period would have probed 24 times
    assert 3 <= idle <= 7, idle
    assert woke > idle          # the last probe was 0.45 s ago: one at the next tick
    # then every 0.05 s: 12 in 0.6 s unless the machine is slow; backed off, at most 2
    assert busy >= 5, busy
