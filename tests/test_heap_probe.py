"""``tetris.heap_probe``: what a process's memory is made of, on real allocations."""

from __future__ import annotations

import sys
import time

import pytest
import ray

from tetris import heap_probe
from tetris.heap_probe import heap_diff, heap_report, malloc_stats, ray_call, trace_start, trace_stop

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
