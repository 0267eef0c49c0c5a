"""Who may hold something of a request on the prefill pool, and calling them for it.

A request's KV and unfinished KV shards can lie only on its plan's members (groups only
grow, so the last group's instances), from the chunk that first runs until ``release`` (after
hand-off) or ``abort``. ``PlanMembers`` remembers them per request from ``commit`` (or
``run``) on, bounded; ``on_workers`` makes one call on each holder, a dead worker answering
None (it holds nothing any more). The chunk driver (``pool.PrefillPool``) frees, exports and
lists requests through them; prefix caching (``prefix.py``) copies a prefix on its holders.
"""

from __future__ import annotations

import collections
import threading

import ray

__all__ = ["PlanMembers", "on_workers"]

_MAX_MEMBERS = 65536   # requests whose plan members are kept for release / abort


class PlanMembers:
    """request -> its plan's instances, from commit (or run) to release or abort: the only
    workers that can hold something of it (``holders``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._members: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._forgot = False   # an entry made room for newer ones (``_MAX_MEMBERS``)

    def note(self, request_id: str, instances: tuple[int, ...]) -> None:
        with self._lock:
            self._members[request_id] = instances
            self._members.move_to_end(request_id)
            while len(self._members) > _MAX_MEMBERS:
                self._members.popitem(last=False)
                self._forgot = True

    def holders(self, request_id: str) -> list[int]:
        """The instances that may hold something of the request (KV, unfinished KV shards):
        its plan's members (the last group: groups only grow), forgotten from now on. Nothing
        runs for a request before it is committed, so one the pool never knew holds nothing;
        one forgotten for room may be anywhere."""
        with self._lock:
            members = self._members.pop(request_id, None)
            if members is None:
                return list(range(self.size)) if self._forgot else []
        return sorted(members)


def on_workers(workers, call, timeout_s: float) -> list:
    """``call(worker)`` (an ObjectRef) on each worker actor, answers in order. A dead
    worker answers None: it holds nothing any more, and it is replaced when a chunk or
    ``connect_receivers`` finds it, so freeing a request must not fail on it."""
    refs = [call(w) for w in list(workers)]
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=timeout_s))
        except ray.exceptions.RayActorError:
            out.append(None)
    return out
