"""``tetris.bench.heap_probe``: what a process's memory is made of, on real allocations."""

from __future__ import annotations

import sys
import time

import pytest
import ray

from tetris.bench import heap_probe
from tetris.bench.heap_probe import heap_diff, heap_report, malloc_stats, ray_call, trace_start, trace_stop

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Kept:
    """A type of our own, so that its count is ours alone."""

    def __init__(self, i: int) -> None:
        self.payload = [i] * 200   # 1.6 kB of item pointers: past pymalloc's 512 B, from malloc


def test_report_reads_rss_malloc_and_object_counts():
    r = heap_report()
    assert r["rss"] > 10 * 2 ** 20
    m = malloc_stats()
    assert m is not None and m["in_use"] > 0 and m["arena"] > 0   # glibc here
    assert r["python"]["objects"] >= sum(r["python"]["types"].values()) > 0
    assert r["tracemalloc"] is None   # not tracing unless asked
    assert r["pymalloc"]["arenas"] >= 1 and r["pymalloc"]["arena_size"] == 2 ** 20


def test_diff_names_the_kept_type_and_the_malloc_growth():
    before = heap_report()
    kept = [Kept(i) for i in range(20_000)]
    after = heap_report()
    d = heap_diff(before, after)
    name = f"{__name__}.Kept"
    assert d["types_grown"][name] == 20_000
    assert d["objects"] >= 20_000
    # 20k item arrays of 1.6 kB each: ~32 MB that malloc handed out, and small objects by pymalloc
    assert d["malloc_in_use_mib"] > 25
    assert d["pymalloc_blocks"] >= 2 * 20_000   # each Kept and its list header
    del kept
    with pytest.raises(ValueError, match="different processes"):
        heap_diff(before, after | {"pid": -1})


_SMALL_OBJECTS = """
import json
from tetris.bench.heap_probe import heap_diff, heap_report
before = heap_report()
kept = [(i, i + 1) for i in range(300_000)]   # a 56 B tuple and two 32 B ints: ~34 MiB of blocks
during = heap_report()
del kept
after = heap_report()
print(json.dumps([heap_diff(before, during), heap_diff(during, after)]))
"""


def test_pymalloc_arenas_and_the_memory_map_follow_small_objects():
    """300k small tuples (and their ints) live in pymalloc's arenas: the arena count, the
    live-block bytes and the map's ``other_anon`` (where those arenas are mapped) all grow by
    about their size; freeing them gives the arenas back (nothing else pins them, they were
    filled in one go). In a fresh interpreter: in the test session's own, Ray's threads map
    and unmap memory meanwhile, which moves ``other_anon`` by megabytes."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", _SMALL_OBJECTS], capture_output=True, text=True,
                         timeout=120, check=True)
    grew, freed = json.loads(out.stdout)
    assert 28 <= grew["pymalloc_blocks_mib"] <= 42
    assert 28 <= grew["pymalloc_arenas_mib"] <= 46
    assert grew["maps_mib"]["other_anon"] >= 25                  # the arenas' pages, touched
    assert abs(grew["maps_mib"]["thread_stacks"]) < 1 and abs(grew["maps_mib"]["malloc_arenas"]) < 2
    assert freed["pymalloc_arenas_mib"] <= -25 and freed["maps_mib"]["other_anon"] <= -20


_THREADS = """
import json, threading, time
from tetris.bench.heap_probe import memory_map
before = memory_map()
release = threading.Event()
held = []

def allocate():
    held.extend(bytearray(b"x" * 100_000) for _ in range(80))   # 8 MB, under the mmap threshold
    release.wait()

threads = [threading.Thread(target=release.wait) for _ in range(4)]
threads.append(threading.Thread(target=allocate))
for t in threads:
    t.start()
while len(held) < 80:
    time.sleep(0.01)
during = memory_map()
release.set()
for t in threads:
    t.join()
print(json.dumps([before, during]))
"""


def test_memory_map_puts_thread_stacks_and_thread_arenas_in_their_own_kinds():
    """Every thread has an 8 MiB stack mapping (glibc may reuse an exited thread's, so the count
    of mappings, not their growth, is checked); a thread that mallocs mid-size blocks gets a
    glibc arena of its own, 64 MiB-aligned. In a fresh interpreter with glibc's defaults (the
    test session has Ray's threads, which come and go)."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _THREADS], capture_output=True, text=True,
                         timeout=120, check=True, env=env)
    before, during = json.loads(out.stdout)
    assert during["threads"] - before["threads"] == 5
    assert during["thread_stack_maps"] >= 5 and during["thread_stacks"] >= 5 * 4096
    assert during["malloc_arenas"] - before["malloc_arenas"] >= 7 * 2 ** 20
    assert set(heap_probe.MAP_KINDS) <= set(during)


def test_tracing_names_the_allocation_site_that_grew():
    trace_start(frames=4)
    try:
        kept = [bytearray(1000) for _ in range(5000)]   # ~5 MB at this line
        d = heap_diff(heap_report(), heap_report())
        top = heap_report()["tracemalloc"]["top_growth"]
    finally:
        trace_stop()
    assert d["traced_mib"] > 4
    assert top and top[0]["size_diff"] > 4_000_000
    assert any(__file__ in f for f in top[0]["frames"])
    assert len(kept) == 5000 and heap_report()["tracemalloc"] is None


def test_ray_call_runs_in_the_actor_process_and_refuses_unknown_actions(ray_session):
    @ray.remote(num_cpus=0)
    class Holder:
        def keep(self, n: int) -> int:
            import os

            self.kept = [Kept(i) for i in range(n)]
            return os.getpid()

    def report() -> dict:
        token = ray.get(h.__ray_call__.remote(ray_call, "submit", action="report"))
        while True:   # the report runs on a thread of the actor's; poll until it is done
            done, result = ray.get(h.__ray_call__.remote(ray_call, "poll", token=token))
            if done:
                return result
            time.sleep(0.05)

    h = Holder.remote()
    before = report()
    pid = ray.get(h.keep.remote(3000))
    after = report()
    assert before["pid"] == after["pid"] == pid
    assert heap_diff(before, after)["types_grown"][f"{__name__}.Kept"] == 3000
    with pytest.raises(Exception, match="unknown heap probe action"):
        ray.get(h.__ray_call__.remote(ray_call, "submit", action="explode"))
    with pytest.raises(Exception, match="no heap probe job"):
        ray.get(h.__ray_call__.remote(ray_call, "poll", token="nope"))
    ray.kill(h)
    assert heap_probe._ACTIONS.keys() == {"report", "trace_start", "trace_stop"}
