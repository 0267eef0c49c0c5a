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
- ``pymalloc``: Python's small-object allocator's arenas (1 MiB each on 3.10+), how many it holds
  and how much of them is in live blocks (from ``sys._debugmallocstats``): an arena returns to
  the system only when its last block is freed, so a few survivors pin a whole MiB;
- ``maps``: the process's private (anonymous) memory by kind of mapping, from
  ``/proc/self/smaps``: the main heap, glibc's thread arenas, thread stacks, private copies of
  file pages, and everything else mapped anonymously (pymalloc arenas, malloc's big blocks,
  native libraries' own pools). This is what the soak's criterion measures, split;
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
import os
import re
import sys
import tempfile
import threading
import tracemalloc
import uuid
from collections import Counter

__all__ = ["heap_report", "heap_diff", "trace_start", "trace_stop", "ray_call", "malloc_stats",
           "memory_map", "pymalloc_stats"]

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


_ARENA_ALIGN = 64 * _MIB        # glibc's HEAP_MAX_SIZE on 64-bit: thread arenas start aligned to it
_STACK_KIB = 8192               # pthread's default stack (RLIMIT_STACK), what threading uses
_MAP_HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\d+)\s*(.*)$")
MAP_KINDS = ("heap", "stack", "malloc_arenas", "thread_stacks", "file_copies", "other_anon")


def memory_map(pid: int | str = "self") -> dict:
    """Private anonymous bytes (smaps ``Anonymous``) by kind of mapping (module docstring), plus
    ``threads`` (the process's thread count) and ``thread_stack_maps`` (8 MiB stacks mapped: live
    threads', and those glibc caches from exited threads for reuse). Shared memory (Ray's
    object store) is not in it."""
    kinds = dict.fromkeys(MAP_KINDS, 0)
    kinds["thread_stack_maps"] = 0
    kind = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = _MAP_HEAD.match(line)
            if head:
                start, end, perms, inode, path = head.groups()
                size_kib = (int(end, 16) - int(start, 16)) // 1024
                if path == "[heap]":
                    kind = "heap"
                elif path.startswith("[stack"):
                    kind = "stack"
                elif inode != "0" or path.startswith("/"):
                    kind = "file_copies"
                elif path.startswith("["):       # [vdso], [vvar], [anon:...]: other
                    kind = "other_anon"
                elif int(start, 16) % _ARENA_ALIGN == 0 and size_kib <= _ARENA_ALIGN // 1024:
                    kind = "malloc_arenas"
                elif size_kib == _STACK_KIB and "w" in perms:
                    kind = "thread_stacks"
                    kinds["thread_stack_maps"] += 1
                else:
                    kind = "other_anon"
            elif kind is not None and line.startswith("Anonymous:"):
                kinds[kind] += int(line.split()[1]) * 1024
    kinds["threads"] = len(os.listdir(f"/proc/{pid}/task"))
    return kinds


_stats_lock = threading.Lock()
_PYMALLOC_LINES = {"# arenas allocated current": "arenas", "# arenas highwater mark": "arenas_peak",
                   "# bytes in allocated blocks": "blocks_bytes",
                   "# bytes in available blocks": "free_block_bytes"}


def pymalloc_stats() -> dict | None:
    """pymalloc's arenas now: ``arenas`` held (and ``arena_bytes``), their high-water mark, bytes
    in live blocks and in free blocks of used pools. None where Python was built without it, and
    while tracemalloc traces (its hooks replace the allocator, and CPython then prints nothing).

    ``sys._debugmallocstats`` prints to the C stderr, so fd 2 points at a temporary file for the
    call (C stdio flushed before it points back); lines other threads write meanwhile are copied
    back to stderr afterwards."""
    if not hasattr(sys, "_debugmallocstats"):
        return None
    with _stats_lock, tempfile.TemporaryFile(mode="w+b") as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
            _libc_fflush()        # C stderr may be buffered (a Ray worker's is): empty it here
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    out: dict = {}
    foreign = []
    for line in text.splitlines():
        key, _, value = line.partition("=")
        name = _PYMALLOC_LINES.get(key.strip())
        if name:
            out[name] = int(value.strip().replace(",", ""))
        elif "bytes/arena" in key:
            out["arena_size"] = int(key.split("*")[1].split()[0])
        elif not _is_mallocstats_line(line):
            foreign.append(line)
    if foreign:
        sys.stderr.write("\n".join(foreign) + "\n")
    if "arenas" not in out:
        return None
    out["arena_bytes"] = out["arenas"] * out.get("arena_size", _MIB)
    return out


def _libc_fflush() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


_MALLOCSTATS_LINE = re.compile(r"^(\s*$|-+\s|Small block threshold|class |#|\s*\d|Total|arena map|"
                               r"\d+ (arenas|unused pools|free))")


def _is_mallocstats_line(line: str) -> bool:
    return bool(_MALLOCSTATS_LINE.match(line))


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
    out = {"pid": os.getpid(), "rss": _rss(), "malloc": malloc_stats(), "maps": memory_map(),
           "pymalloc": pymalloc_stats(),
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
    pb, pa = before.get("pymalloc"), after.get("pymalloc")
    if pb and pa:
        out["pymalloc_arenas_mib"] = (pa["arena_bytes"] - pb["arena_bytes"]) / _MIB
        out["pymalloc_blocks_mib"] = (pa["blocks_bytes"] - pb["blocks_bytes"]) / _MIB
    if before.get("maps") and after.get("maps"):
        out["maps_mib"] = {k: (after["maps"][k] - before["maps"][k]) / _MIB for k in MAP_KINDS}
        out["threads"] = after["maps"]["threads"] - before["maps"]["threads"]
    tb, ta = before["python"]["types"], after["python"]["types"]
    grown = {t: ta[t] - tb.get(t, 0) for t in ta if ta[t] - tb.get(t, 0) > 0}
    out["objects"] = after["python"]["objects"] - before["python"]["objects"]
    out["pymalloc_blocks"] = after["python"]["pymalloc_blocks"] - before["python"]["pymalloc_blocks"]
    out["types_grown"] = dict(sorted(grown.items(), key=lambda kv: -kv[1])[:top])
    if after.get("tracemalloc"):
        out["traced_mib"] = after["tracemalloc"]["current"] / _MIB
        out["top_sites"] = after["tracemalloc"]["top_growth"][:top]
    return out
