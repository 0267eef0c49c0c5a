"""Timer slack for the threads gloo groups start (actors/timer_slack.py)."""

import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from tetris.actors import collectives, timer_slack

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")


def _slack(tid: int) -> int:
    return int(Path(f"/proc/{tid}/timerslack_ns").read_text())


def _thread_slack() -> int:
    seen = []
    t = threading.Thread(target=lambda: seen.append(_slack(threading.get_native_id())))
    t.start()
    t.join()
    return seen[0]


def test_threads_started_inside_get_the_slack_and_the_caller_gets_its_own_back():
    me = threading.get_native_id()
    before = _slack(me)
    with timer_slack.loose_timers(20_000_000) as ns:
        assert ns == 20_000_000
        assert _thread_slack() == 20_000_000
    assert _slack(me) == before
    assert _thread_slack() == before


def test_unset_or_zero_changes_nothing(monkeypatch):
    me = threading.get_native_id()
    before = _slack(me)
    for value in (None, "0", "junk"):
        if value is None:
            monkeypatch.delenv(timer_slack.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(timer_slack.ENV_VAR, value)
        with timer_slack.loose_timers() as ns:
            assert ns == 0
            assert _thread_slack() == before


def _gloo_threads() -> dict[int, int]:
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "gloo_tcp_loop":
                out[int(task.name)] = _slack(int(task.name))
        except OSError:
            pass
    return out


def test_a_gloo_groups_transport_thread_gets_the_slack_from_the_environment(monkeypatch):
    monkeypatch.setenv(timer_slack.ENV_VAR, "30")
    old = set(_gloo_threads())
    group = collectives.process_group(dist.HashStore(), 0, 1, "gloo", timedelta(seconds=30))
    deadline = time.monotonic() + 10   # the thread names itself once it runs
    while not (new := {t: ns for t, ns in _gloo_threads().items() if t not in old}):
        assert time.monotonic() < deadline, "no gloo_tcp_loop thread appeared"
        time.sleep(0.01)
    assert set(new.values()) == {30_000_000}
    assert _slack(threading.get_native_id()) != 30_000_000
    del group
