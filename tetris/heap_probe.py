"""What a process's memory is made of: RSS, glibc's heap, Python objects by type, tracemalloc.

A soak that sees an actor's RSS grow needs to know whether Python objects were kept (a leak in
our code or a library's), or the C heap holds freed memory it cannot return (fragmentation:
glibc keeps a freed chunk until everything above it in its arena is free too). One report tells
them apart:

- ``malloc``: glibc's ``mallinfo2`` (``in_use`` = bytes malloc handed out and not freed, ``free``
  = bytes freed but still held by the heap, ``mmapped`` = big blocks mapped one by one);
- ``python``: live objects tracked by the garbage collector, counted by type (containers only:
  ints, floats and strings are not tracked, but the lists and dicts holding them are), and
  ``pymalloc_blocks``, the blocks Python's small-object allocator has out (objects up to 512 B
  live in its own mmapped arenas, which ``malloc`` does not see);
- ``tracemalloc``: when tracing was started, the allocation sites whose live bytes grew most
  since the start, from Python's own allocator hooks (this is the leak finder; tracing costs
  time and memory, so it runs only while asked for).

``heap_diff(before, after)`` compares two reports. ``ray_call`` runs an action inside any Ray
actor through ``ActorHandle.__ray_call__`` (Serve replicas included), so a benchmark can probe
the processes it only knows by handle. In an async actor ``__ray_call__`` runs on the event
loop, and a report of a big traced heap takes seconds to minutes: long enough for Serve to
fail the replica's health checks and kill it. So ``ray_call(.., "submit", action=...)`` starts
the action on a thread of its own and returns a token at once, and ``ray_call(.., "poll",
token=...)`` returns ``(done, result)``: the loop keeps serving (the GIL is shared, so it
slows down meanwhile, but it never stops). Pure stdlib: no torch, no ray at module level.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import uuid
import os
import sys
import tracemalloc
from collections import Counter

__all__ = ["heap_report", "heap_diff", "trace_start", "trace_stop", "ray_call", "malloc_stats"]

_MIB = 2 ** 20
_baseline: tracemalloc.Snapshot | None = None


class _Mallinfo2(ctypes.Structure):
    # glibc >= 2.33, every field a size_t (man 3 mallinfo2)
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_stats() -> dict | None:
    """glibc's heap in bytes, or None where mallinfo2 is missing (musl, macOS, old glibc).

    Summed over all arenas (glibc's mallinfo2 walks them; checked here by allocating from a
    second thread), which matters in a Ray actor: most allocations come from threads other than
    the main one (a Serve replica runs its user code on a thread of its own)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return {"arena": m.arena, "mmapped": m.hblkhd, "in_use": m.uordblks + m.hblkhd,
            "free": m.fordblks, "top_releasable": m.keepcost}


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _type_counts() -> Counter:
    counts: Counter = Counter()
    for obj in gc.get_objects():
        t = type(obj)
        counts[f"{t.__module__}.{t.__qualname__}"] += 1
    return counts


def heap_report(top_types: int = 200, top_sites: int = 15) -> dict:
    """This process's memory now (module docstring): RSS, malloc, objects by type, tracemalloc."""
    gc.collect()
    counts = _type_counts()
    out = {"pid": os.getpid(), "rss": _rss(), "malloc": malloc_stats(),
           "python": {"objects": sum(counts.values()), "pymalloc_blocks": sys.getallocatedblocks(),
                      "types": dict(counts.most_common(top_types))},
           "tracemalloc": None}
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        out["tracemalloc"] = {"current": current, "peak": peak, "top_growth": _top_growth(top_sites)}
    return out


def _top_growth(n: int) -> list[dict]:
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)])
    if _baseline is None:
        return []
    stats = snap.compare_to(_baseline, "traceback")
    rows = []
    for s in sorted(stats, key=lambda s: -s.size_diff)[:n]:
        if s.size_diff <= 0:
            break
        frames = [f"{f.filename}:{f.lineno}" for f in s.traceback[-4:]]
        rows.append({"size_diff": s.size_diff, "count_diff": s.count_diff, "frames": frames})
    return rows


def trace_start(frames: int = 4) -> bool:
    """Start tracemalloc here (if not yet) and take the baseline later reports compare to."""
    global _baseline
    if not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    gc.collect()
    _baseline = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)])
    return True


def trace_stop() -> bool:
    global _baseline
    _baseline = None
    if tracemalloc.is_tracing():
        tracemalloc.stop()
    return True


_ACTIONS = {"report": heap_report, "trace_start": trace_start, "trace_stop": trace_stop}
_jobs: dict[str, dict] = {}     # token -> {"done": Event, "result": ..., "error": ...}
_jobs_lock = threading.Lock()


def _submit(action: str, kwargs: dict) -> str:
    if action not in _ACTIONS:
        raise ValueError(f"unknown heap probe action {action!r}; expected one of {sorted(_ACTIONS)}")
    token = uuid.uuid4().hex
    job = {"done": threading.Event(), "result": None, "error": None}

    def work() -> None:
        try:
            job["result"] = _ACTIONS[action](**kwargs)
        except Exception as e:  # noqa: BLE001 - handed to the poller, which raises it
            job["error"] = e
        finally:
            job["done"].set()

    with _jobs_lock:
        _jobs[token] = job
    threading.Thread(target=work, name=f"tetris-heap-{action}", daemon=True).start()
    return token


def _poll(token: str) -> tuple[bool, object]:
    with _jobs_lock:
        job = _jobs.get(token)
        if job is None:
            raise ValueError(f"no heap probe job {token!r} in process {os.getpid()}")
        if not job["done"].is_set():
            return False, None
        del _jobs[token]
    if job["error"] is not None:
        raise job["error"]
    return True, job["result"]


def ray_call(_actor_self, op: str, *, action: str = "", token: str = "", **kwargs):
    """``handle.__ray_call__.remote(ray_call, op, ...)`` in an actor's process (module docstring):
    ``"submit"`` with ``action`` (and its keyword arguments) returns a token; ``"poll"`` with
    ``token`` returns ``(done, result)`` and raises the action's error."""
    if op == "submit":
        return _submit(action, kwargs)
    if op == "poll":
        return _poll(token)
    raise ValueError(f"unknown heap probe op {op!r}; expected 'submit' or 'poll'")


def heap_diff(before: dict, after: dict, top: int = 10) -> dict:
    """Growth between two ``heap_report``s of one process, in MiB and object counts."""
    if before["pid"] != after["pid"]:
        raise ValueError(f"reports of different processes ({before['pid']} vs {after['pid']})")
    out = {"rss_mib": (after["rss"] - before["rss"]) / _MIB}
    mb, ma = before["malloc"], after["malloc"]
    if mb and ma:
        out["malloc_in_use_mib"] = (ma["in_use"] - mb["in_use"]) / _MIB
        out["malloc_free_mib"] = (ma["free"] - mb["free"]) / _MIB
    tb, ta = before["python"]["types"], after["python"]["types"]
    grown = {t: ta[t] - tb.get(t, 0) for t in ta if ta[t] - tb.get(t, 0) > 0}
    out["objects"] = after["python"]["objects"] - before["python"]["objects"]
    out["pymalloc_blocks"] = after["python"]["pymalloc_blocks"] - before["python"]["pymalloc_blocks"]
    out["types_grown"] = dict(sorted(grown.items(), key=lambda kv: -kv[1])[:top])
    if after.get("tracemalloc"):
        out["traced_mib"] = after["tracemalloc"]["current"] / _MIB
        out["top_sites"] = after["tracemalloc"]["top_growth"][:top]
    return out
