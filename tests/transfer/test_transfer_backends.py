"""Backend selection by capability, the loud fallback, and a NIXL write with its notification."""

from __future__ import annotations

import logging

import pytest
import torch

from tetris.transfer import backends
from tetris.transfer.backends import InProcAgent, make_agent, nixl_unavailable_reason


def test_missing_nixl_falls_back_loudly(monkeypatch, caplog):
    monkeypatch.setattr(backends, "nixl_unavailable_reason", lambda: "nixl cannot be imported (test)")
    with caplog.at_level(logging.WARNING, logger="tetris.transfer.backends"):
        agent = make_agent("fallback-a")
    try:
        assert isinstance(agent, InProcAgent) and not agent.capabilities.cross_process
        assert "falls back to the in-process backend" in caplog.text and "nixl cannot be imported" in caplog.text
    finally:
        agent.close()
    with pytest.raises(RuntimeError, match="'nixl' requested"):
        make_agent("fallback-b", backend="nixl")


def _write_and_notify(a, b):
    src = torch.arange(64, dtype=torch.float32)
    dst = torch.zeros(128, dtype=torch.float32)
    a.register(src)
    region = b.register(dst)
    a.add_peer(b.info())
    handle = a.write(src[8:40], region, 16 * 4, b"piece-1")
    for _ in range(100000):
        status = a.status(handle)
        if status != "proc":
            break
    assert status == "done"
    a.release(handle)
    notes = []
    for _ in range(100000):
        notes += b.notifications()
        if notes:
            break
    assert notes == [(a.name, b"piece-1")]
    assert torch.equal(dst[16:48], src[8:40]) and not dst[:16].any() and not dst[48:].any()


def test_inproc_agents_write_with_notification():
    a, b = InProcAgent("inproc-a"), InProcAgent("inproc-b")
    try:
        _write_and_notify(a, b)
        with pytest.raises(ValueError, match="does not know peer"):
            b.write(torch.zeros(4), a.register(torch.zeros(4)), 0, b"")
    finally:
        a.close()
        b.close()


def test_nixl_agents_write_with_notification():
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    a, b = make_agent("nixl-test-a", backend="nixl"), make_agent("nixl-test-b", backend="nixl")
    try:
        assert a.backend == "nixl-ucx" and a.capabilities.cross_process
        _write_and_notify(a, b)
        with pytest.raises(ValueError, match="overflows"):
            a.write(torch.zeros(200), b.register(torch.zeros(8)), 0, b"")
    finally:
        a.close()
        b.close()


def test_a_replaced_nixl_peer_is_reached_at_its_new_address():
    """A receiver's process is replaced (a restarted decode rank): its agent comes back under
    the same name with new metadata, and the sender's next ``add_peer`` swaps the old peer for
    the new one, so writes land in the new process's memory."""
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    a = make_agent("nixl-replace-a", backend="nixl")
    old = make_agent("nixl-replace-b", backend="nixl")
    try:
        _write_and_notify(a, old)
        old_info = old.info()
        a.add_peer(old_info)                        # the same info again: nothing to do
        old.close()
        new = make_agent("nixl-replace-b", backend="nixl")
        try:
            assert new.info().metadata != old_info.metadata
            _write_and_notify(a, new)               # add_peer(new.info()) replaces the peer
        finally:
            new.close()
    finally:
        a.close()


def test_an_idle_nixl_agent_sleeps_and_still_wakes_at_once(monkeypatch):
    """nixl's Python wrapper gives every agent's UCX progress thread a poll() timeout of 0: the
    thread spun, a quarter of a core per agent (80% of it system time) in every prefill worker
    and decode rank of an idle server. ``new_nixl_agent`` gives it a real timeout; traffic
    still wakes it through the UCX event fds, not the timeout: with a 2 s timeout a write's
    notice after an idle spell still lands within milliseconds."""
    import time

    import psutil

    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("TETRIS_NIXL_PROGRESS_DELAY_MS", "2000")
    a, b = make_agent("nixl-idle-a", backend="nixl"), make_agent("nixl-idle-b", backend="nixl")
    try:
        _write_and_notify(a, b)                 # connected: both progress threads run
        proc = psutil.Process()
        c0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(1.5)
        used = (sum(proc.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
        assert used < 0.05, f"two idle agents used {used:.0%} of a core"
        src, dst = torch.arange(16, dtype=torch.float32), torch.zeros(16, dtype=torch.float32)
        a.register(src)
        region = b.register(dst)
        a.add_peer(b.info())                    # b's metadata now names the new region
        for i in range(3):
            time.sleep(0.3)                     # both threads back asleep in poll()
            start = time.monotonic()
            handle = a.write(src, region, 0, b"after-idle-%d" % i)
            while (status := a.status(handle)) == "proc":
                assert time.monotonic() - start < 1.0, "the write did not complete"
                time.sleep(0.0002)
            assert status == "done"
            a.release(handle)
            notes = []
            while not notes:
                notes = b.notifications()
                assert time.monotonic() - start < 1.0, "no notice within 1 s"
                time.sleep(0.0002)
            assert notes == [(a.name, b"after-idle-%d" % i)]
            assert time.monotonic() - start < 0.2   # woken by the traffic, not the 2 s timeout
    finally:
        a.close()
        b.close()


def test_the_progress_delay_setting_is_checked(monkeypatch):
    from tetris.transfer.backends.nixl_ucx import PROGRESS_DELAY_MS, progress_delay_ms

    monkeypatch.delenv("TETRIS_NIXL_PROGRESS_DELAY_MS", raising=False)
    assert progress_delay_ms() == PROGRESS_DELAY_MS > 0
    monkeypatch.setenv("TETRIS_NIXL_PROGRESS_DELAY_MS", "25")
    assert progress_delay_ms() == 25.0
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("TETRIS_NIXL_PROGRESS_DELAY_MS", bad)
        with pytest.raises(ValueError, match="TETRIS_NIXL_PROGRESS_DELAY_MS"):
            progress_delay_ms()
