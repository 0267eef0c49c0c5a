"""Joining and probing the prefill workers: the driver's side of one world generation.

``form_world`` has a list of workers join a generation of the world (actors/prefill/world.py)
and says which of them were found dead meanwhile; ``dead_among`` probes workers for the dead
ones. The world keeper (``worlds.WorldKeeper``) decides when a generation forms and with which
workers; these functions only make the Ray calls and sort the answers.
"""

from __future__ import annotations

import ray

from tetris.actors.prefill.messages import first_line

__all__ = ["dead_among", "form_world"]


def form_world(workers: list, generation: int, timeout_s: float) -> dict[int, object]:
    """Have ``workers`` join generation ``generation`` of the world, its store in worker 0
    on a port free on worker 0's node. Workers join beside the chunks they run.

    Returns the workers found dead meanwhile (instance -> handle; the world is not formed
    then). Every join has ended, one way or the other, before this returns: a worker's
    joins run one at a time, so a join left waiting would make the next attempt's time
    out too. Raises if the world did not form for another reason (a timeout)."""
    timeout = max(120.0, timeout_s)
    try:
        host, port = ray.get(workers[0].store_address.remote(), timeout=timeout)
    except ray.exceptions.RayActorError:
        return {0: workers[0]}
    refs = [w.join_world.remote(generation, host, port, len(workers), timeout_s)
            for w in workers]
    ray.wait(refs, num_returns=len(refs), timeout=timeout)
    dead, failed = {}, []
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead[i] = workers[i]
        except Exception as e:  # noqa: BLE001 - reported together below
            failed.append(f"instance {i}: {type(e).__name__}: {first_line(e)}")
    if not dead and failed:
        raise RuntimeError(f"world {generation} did not form: {'; '.join(failed[:3])}")
    return dead


def dead_among(workers: list, timeout_s: float) -> dict:
    """instance -> handle of the workers known dead after probing them all (``alive``) for at
    most ``timeout_s``; one that does not answer in time is not counted dead."""
    refs = [w.alive.remote() for w in workers]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    dead = {}
    for i, (w, ref) in enumerate(zip(workers, refs)):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead[i] = w
        except ray.exceptions.GetTimeoutError:
            pass
    return dead
