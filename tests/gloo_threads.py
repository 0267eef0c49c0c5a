"""Ranks as threads of one process on one gloo world: ``run_ranks(size, fn)`` calls
``fn(rank, world)`` on a thread per rank, each with its own ``World`` of the same generation,
and returns their results in rank order (the first error of any rank fails the call)."""

from __future__ import annotations

import threading

from tetris.actors.prefill.world import World, free_port

__all__ = ["run_ranks"]


def run_ranks(size: int, fn, *, timeout_s: float = 60.0, world_timeout_s: float = 20.0) -> list:
    port, outs, errors = free_port(), [None] * size, []

    def rank(r: int) -> None:
        try:
            outs[r] = fn(r, World(0, "127.0.0.1", port, r, size, timeout_s=world_timeout_s))
        except Exception as e:  # noqa: BLE001 - raised below, with its rank
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not any(t.is_alive() for t in threads), f"ranks still running after {timeout_s}s"
    assert not errors, errors
    return outs
