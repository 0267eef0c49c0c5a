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
