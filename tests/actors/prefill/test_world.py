"""Generations of the pool's world (actors/prefill/world.py), in one process: ranks are threads."""

from __future__ import annotations

import threading

import pytest
import torch

from tetris.actors.prefill.world import World, free_port


def _form(generation: int, size: int, port: int) -> list[World]:
    """Every rank constructs its World at once (the full mesh connects in the constructor)."""
    worlds: list = [None] * size
    errors: list = []

    def join(rank: int) -> None:
        try:
            worlds[rank] = World(generation, "127.0.0.1", port, rank, size, timeout_s=20.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return worlds


def _ring(worlds: list[World], tag: int) -> list[list[float]]:
    """Each rank sends its rank to the next and receives from the previous, concurrently."""
    size = len(worlds)
    got: list = [None] * size

    def step(r: int) -> None:
        out = torch.full((3,), float(r + 10 * worlds[r].generation))
        buf = torch.empty(3)
        works = [worlds[r].isend(out, (r + 1) % size, tag), worlds[r].irecv(buf, (r - 1) % size, tag)]
        for w in works:
            w.wait()
        got[r] = buf.tolist()

    threads = [threading.Thread(target=step, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return got


def test_a_new_generation_forms_and_carries_traffic_while_the_old_one_is_in_use():
    old = _form(0, 3, free_port())
    assert _ring(old, tag=1) == [[2.0] * 3, [0.0] * 3, [1.0] * 3]
    # generation 1 forms while generation 0 carries a ring on the same ranks
    formed: dict = {}
    former = threading.Thread(target=lambda: formed.update(new=_form(1, 3, free_port())))
    former.start()
    during = _ring(old, tag=2)
    former.join(timeout=60)
    new = formed["new"]
    assert during == [[2.0] * 3, [0.0] * 3, [1.0] * 3]
    assert _ring(new, tag=1) == [[12.0] * 3, [10.0] * 3, [11.0] * 3]
    for w in old:
        w.close()
    assert _ring(new, tag=3) == [[12.0] * 3, [10.0] * 3, [11.0] * 3]   # unaffected by the drop


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 3 outside a world of 3"):
        World(0, "127.0.0.1", free_port(), 3, 3, timeout_s=1.0)
