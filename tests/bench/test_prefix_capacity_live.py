"""The EMULATION capacity search of prefix caching (``tetris.bench.prefix_live.live_capacity``)
on a stand-in for the live app whose TTFTs are the simulator's: the search must then find the
simulator's capacity through the same probes (the same trace at each rate, one SLO, the
simulator's bisection), clear the cache after every probe, and count a probe with failed
requests as not sustained. The live app itself runs in benchmarks/bench_prefix_cache_emulated.py
(its deploy takes minutes, not a test's seconds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tetris.bench.prefix_live import live_capacity
from tetris.sim.prefix_experiments import (
    prefix_capacity,
    run_prefix,
    slo_from_light_load,
)
from tetris.sim.prefix_workload import PrefixWorkload, shared_prefix_workload

SPEC = PrefixWorkload(documents=4, sessions=2, doc_tokens=(65536, 131072),
                      session_context=(4096, 8192), block_tokens=512, concurrent_streams=3)
SEARCH = {"lo": 0.5, "hi": 1.0, "tol": 0.25, "max_rate": 16.0}


class _Done:
    def __init__(self, value) -> None:
        self.value = value

    def result(self, timeout_s: float):
        return self.value


class SimulatedApp:
    """What ``live_capacity`` reads of a ``PrefixLiveCluster``; TTFTs from ``run_prefix``
    (cache on), requests failing when sent faster than ``fail_above`` req/s."""

    def __init__(self, fail_above: float = float("inf")) -> None:
        self.fail_above = fail_above
        self.clears = 0
        self.queries = 0
        self.dispatcher = SimpleNamespace(prefix_cache=SimpleNamespace(remote=self._view))

    def _view(self, clear: bool = False):
        self.clears += clear
        return _Done({"queries": self.queries, "hits": 0})

    async def run_trace(self, trace, time_scale: float) -> dict:
        rate = _trace_at(1.0)[-1].arrival_time / trace[-1].arrival_time   # arrivals scale as 1/rate
        _, sim = run_prefix(trace, cache=True, block_tokens=SPEC.block_tokens, rate=rate)
        self.queries += len(trace)
        failed = len(trace) if rate > self.fail_above else 0
        return {"ttft_s": [float(x) for x in sim.ttft], "prefill_ttft_s": [], "timelines": [],
                "failed": failed, "errors": ["refused"] if failed else []}

    def held(self) -> dict:
        return {"dispatcher": {"inflight": 0}, "prefill": {}, "decode": []}


def _trace_at(rate: float):
    return shared_prefix_workload(SPEC, rate, 0)


def test_on_the_simulators_ttfts_the_live_search_finds_the_simulators_capacity():
    slo = slo_from_light_load(SPEC, 0, 0.25, factor=3.0)
    want, sim_probes = prefix_capacity(SPEC, 0, cache=True, slo=slo, **SEARCH)
    app = SimulatedApp()
    got, probes = live_capacity(app, _trace_at, slo, time_scale=4.0, **SEARCH)
    assert got == want and 0.5 < got < 16.0   # a knee inside the bracket
    assert [p["rate"] for p in probes] == [p[0] for p in sim_probes]
    assert [p["met"] for p in probes] == [p[3] for p in sim_probes]
    for p, s in zip(probes, sim_probes):
        assert p["p50"] == pytest.approx(s[1], rel=1e-9) and p["p99"] == pytest.approx(s[2])
    assert app.clears == len(probes)   # every probe starts from an empty cache
    assert all(p["probe_hits"]["queries"] == len(_trace_at(1.0)) for p in probes)


def test_a_probe_with_failed_requests_is_not_sustained():
    slo = slo_from_light_load(SPEC, 0, 0.25, factor=3.0)
    capped, probes = live_capacity(SimulatedApp(fail_above=2.0), _trace_at, slo,
                                   time_scale=1.0, **SEARCH)
    assert 0.5 <= capped <= 2.0
    assert all(not p["met"] for p in probes if p["failed"])
    # a probe above 2 req/s met the TTFT SLO: only its failed requests made it unsustained
    assert any(p["rate"] > 2.0 and p["failed"] and p["p50"] <= slo[0] and p["p99"] <= slo[1]
               for p in probes)
