"""Decode latency ratios (paper Fig. 2a), virtual-usage routing, improvement-rate table/monitor."""

from __future__ import annotations

import pytest

from tetris.scheduler.decode_latency import DecodeLatencyModel
from tetris.scheduler.rate import ImprovementRateTable, RateMonitor, RateTableError
from tetris.scheduler.router import DecodeRouter, NoInstanceUp, RouterError

# Our Fig. 2a grid: batch 1-64, 4k-128k tokens per request, where the KV fits the TP size.
GRID = [(b, c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (4096, 8192, 16384, 32768, 65536, 131072)]
PAPER = {1: 5.73, 2: 3.87, 4: 1.93}


def test_decode_slowdowns_vs_tp8_match_the_paper_within_12_percent():
    m = DecodeLatencyModel.for_model("llama3-8b")
    for tp, paper in PAPER.items():
        cap = m.kv_capacity_tokens(tp)
        worst = max(m.step_time(tp, b, b * c) / m.step_time(8, b, b * c)
                    for b, c in GRID if b * c <= cap)
        assert worst == pytest.approx(paper, rel=0.12), tp
    # Where it peaks for TP 1: the largest batch x context that fits one GPU (2 x 128k).
    assert m.step_time(1, 2, 262144) / m.step_time(8, 2, 262144) == pytest.approx(6.09, abs=0.01)


def test_decode_step_grows_with_context_and_batch_and_70b_is_slower():
    m8, m70 = DecodeLatencyModel.for_model("8b"), DecodeLatencyModel.for_model("LLaMA3-70B")
    assert m8.step_time(8, 16, 200000) > m8.step_time(8, 16, 100000) > m8.step_time(8, 1, 100000)
    assert m70.step_time(8, 16, 100000) > 4 * m8.step_time(8, 16, 100000)
    assert m8.step_time(8, 0, 0) == 0.0
    with pytest.raises(ValueError):
        DecodeLatencyModel.for_model("gpt2")
    with pytest.raises(ValueError):
        m8.step_time(0, 1, 1)


def test_router_prefers_freeness_and_counts_virtual_usage():
    r = DecodeRouter([1000, 1000])
    r.update(0, 900, 2)   # freeness 450
    r.update(1, 600, 1)   # freeness 600
    assert r.choose(100) == 1
    r.reserve(1, 300)     # in flight: (600 - 300) / 1 = 300 < 450
    assert r.choose(100) == 0
    r.release(1, 300)
    assert r.choose(100) == 1
    # No room anywhere: still an instance (the request queues there), the freest one.
    assert r.choose(5000) == 1
    # Room beats freeness: instance 0 is less free per request but only it fits 800.
    r.update(0, 900, 8)
    r.update(1, 700, 1)
    assert r.choose(800) == 0
    with pytest.raises(RouterError):
        r.release(0, 1)
    with pytest.raises(RouterError):
        r.reserve(5, 1)


def test_router_skips_instances_marked_down_and_says_when_none_is_up():
    r = DecodeRouter([1000, 1000, 1000])
    r.update(0, 500, 1)
    r.update(2, 600, 1)
    r.update(1, 900, 1)                  # the freest
    assert r.choose(10) == 1
    r.set_up(1, False)
    assert r.choose(10) == 2             # the freest of those up
    r.reserve(1, 50)                     # bookings made before it went down still count
    r.release(1, 50)
    r.set_up(0, False)
    r.set_up(2, False)
    with pytest.raises(NoInstanceUp, match="all 3 decode instances are down"):
        r.choose(10)
    assert not isinstance(NoInstanceUp("x"), ValueError)   # not the client's fault: no 400
    r.set_up(1, True)
    assert r.choose(10) == 1
    with pytest.raises(RouterError):
        r.set_up(3, False)


def test_router_avoids_the_instance_that_lost_a_request_unless_it_is_the_only_one_up():
    r = DecodeRouter([1000, 1000])
    r.update(0, 900, 1)                  # the freest
    r.update(1, 100, 1)                  # no room for 500 tokens
    assert r.choose(500) == 0
    assert r.choose(500, avoid={0}) == 1          # even without room: it waits there
    r.set_up(1, False)
    assert r.choose(500, avoid={0}) == 0          # the only one up
    r.set_up(0, False)
    with pytest.raises(NoInstanceUp):
        r.choose(500, avoid={0})


def test_rate_table_lookup_and_roundtrip(tmp_path):
    t = ImprovementRateTable([2.0, 1.0, 3.0], [0.3, 0.1, 0.6], description="test")
    assert t.rates == [1.0, 2.0, 3.0]
    assert [t.lookup(x) for x in (0.0, 1.4, 1.5, 1.6, 2.9, 10.0)] == [0.1, 0.1, 0.1, 0.3, 0.6, 0.6]
    for suffix in (".toml", ".json"):
        back = ImprovementRateTable.load(t.save(tmp_path / f"t{suffix}"))
        assert back.rates == t.rates and back.improvement_rates == t.improvement_rates
        assert back.description == "test"
    with pytest.raises(RateTableError):
        ImprovementRateTable([1.0], [1.5])
    with pytest.raises(RateTableError):
        ImprovementRateTable.load(tmp_path / "missing.toml")


def test_rate_monitor_sliding_window_and_update_interval():
    table = ImprovementRateTable([0.5, 1.0, 2.0], [0.1, 0.3, 0.6])
    mon = RateMonitor(window_s=10.0, update_interval_s=5.0, table=table)
    for k in range(20):            # 2 req/s for 10 s
        mon.observe_arrival(k * 0.5)
    assert mon.current_rate(9.9) == pytest.approx(20 / 9.9)
    assert mon.maybe_update(10.0) == 0.6
    assert mon.maybe_update(12.0) is None        # not due yet
    for k in range(5):             # then 0.5 req/s
        mon.observe_arrival(10.0 + 2 * k)
    assert mon.current_rate(20.0) == pytest.approx(4 / 10.0)  # window (10, 20]: 10 is out
    assert mon.maybe_update(20.0) == 0.1
    assert mon.improvement_rate == 0.1
    with pytest.raises(RateTableError):
        mon.observe_arrival(1.0)


def test_rate_monitor_warm_up_ignores_the_first_arrivals_then_updates_every_interval():
    # The old monitor updated at the first arrival over a 0.125 s span (8 req/s -> θ 0.4) and
    # kept that θ for 30 s although the load was 1 req/s.
    table = ImprovementRateTable([1.0, 5.0, 10.0], [0.1, 0.4, 0.6])
    mon = RateMonitor(window_s=60.0, update_interval_s=30.0, table=table, start_time=0.0)
    updates = []
    for k in range(100):           # 1 req/s, first arrival at 0.125 s (exact in binary)
        t = k + 0.125
        mon.observe_arrival(t)
        u = mon.maybe_update(t)
        if u is not None:
            updates.append((t, u))
            if t == 30.125:        # over the elapsed time, not the window
                assert mon.current_rate(t) == pytest.approx(31 / 30.125)
    assert updates[0][0] == 7.125                  # the 8th arrival ends the blind start
    assert {u for _, u in updates} == {0.1}        # never the 8 req/s of the first arrival
    warm = [t for t, _ in updates if t < 30.0]
    assert warm == [k + 0.125 for k in range(7, 30)]
    assert [t for t, _ in updates if t >= 30.0] == [30.125, 60.125, 90.125]


def test_rate_monitor_reacts_to_overload_within_the_first_interval():
    table = ImprovementRateTable([1.0, 5.0, 10.0], [0.1, 0.4, 0.6])
    mon = RateMonitor(window_s=60.0, update_interval_s=30.0, table=table, start_time=0.0)
    thetas = []
    for k in range(1, 40):         # 10 req/s
        mon.observe_arrival(0.1 * k)
        mon.maybe_update(0.1 * k)
        thetas.append(mon.improvement_rate)
    assert thetas[:7] == [0.1] * 7 and thetas[7:] == [0.6] * 32


def test_rate_monitor_without_start_time_starts_at_its_first_call():
    # A wall clock: arrivals before the monitor existed are not counted, so the span starts
    # at the first observed time instead of a window that was never watched.
    table = ImprovementRateTable([1.0, 4.0], [0.1, 0.5])
    mon = RateMonitor(window_s=60.0, update_interval_s=10.0, table=table)
    t0 = 1.7e9
    got = []
    for k in range(41):            # 4 req/s for 10 s
        mon.observe_arrival(t0 + 0.25 * k)
        got.append(mon.maybe_update(t0 + 0.25 * k))
    assert got[:7] == [None] * 7 and got[7:] == [0.5] * 34
    assert mon.start_time == t0
    assert mon.current_rate(t0 + 10.0) == pytest.approx(41 / 10.0)
    assert mon.maybe_update(t0 + 15.0) is None     # periodic again: next at t0 + 20
    assert mon.maybe_update(t0 + 20.0) == 0.1      # 41 arrivals over 20 s: nearer 1 req/s
    with pytest.raises(RateTableError):
        RateMonitor(window_s=10.0, update_interval_s=20.0, table=table)


def test_rate_monitor_min_arrivals_stretches_a_sparse_window():
    # 0.5 req/s for 300 s, then 0.33 req/s for the last 60 s: the 60 s window alone reads
    # 20/60 and lands on the 0.375 row; stretched to the 100 most recent arrivals it reads
    # 99 gaps over their span, about 0.45 req/s, the 0.5 row.
    table = ImprovementRateTable([0.375, 0.5], [0.15, 0.55])
    arrivals = [2.0 * k for k in range(150)] + [300.0 + 3.0 * k for k in range(1, 21)]
    plain = RateMonitor(60.0, 30.0, table, start_time=0.0)
    wide = RateMonitor(60.0, 30.0, table, start_time=0.0, min_arrivals=100)
    for t in arrivals:
        plain.observe_arrival(t)
        wide.observe_arrival(t)
    now = arrivals[-1]
    assert plain.current_rate(now) == pytest.approx(20 / 60.0)
    oldest = arrivals[-100]
    assert wide.current_rate(now) == pytest.approx(99 / (now - oldest))
    assert plain.maybe_update(now) == 0.15 and wide.maybe_update(now) == 0.55
    # A window that already holds enough arrivals is not stretched.
    dense = RateMonitor(60.0, 30.0, table, start_time=0.0, min_arrivals=100)
    for k in range(400):
        dense.observe_arrival(0.25 * k)
    assert dense.current_rate(100.0) == pytest.approx(239 / 60.0)   # (40, 100]
    # Before one window has passed the span is the elapsed time, as without min_arrivals.
    early = RateMonitor(60.0, 30.0, table, start_time=0.0, min_arrivals=100)
    for k in range(10):
        early.observe_arrival(4.0 * k)
    assert early.current_rate(40.0) == pytest.approx(10 / 40.0)
    with pytest.raises(RateTableError):
        RateMonitor(60.0, 30.0, table, min_arrivals=-1)
