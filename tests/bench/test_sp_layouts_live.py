"""The capacity helpers of the live SP-layout benchmark (#26): the simulator's SLO, the
bisection on one deployment's trace, the coarse live bracket and the tailed trace."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tetris.bench.fidelity import simulate, trace_for
from tetris.bench.sp_layouts_live import (
    coarse_capacity,
    layout_trace,
    sim_capacity,
    sustained,
)
from tetris.config import SpLayoutConfig, load_deployment
from tetris.sim.experiments import SLO_FACTOR


def test_sustained_is_the_simulators_slo_and_no_failure():
    light = (0.5, 2.0)
    assert sustained(SLO_FACTOR * 0.5, SLO_FACTOR * 2.0, light)
    assert not sustained(SLO_FACTOR * 0.5 + 1e-9, 1.0, light)
    assert not sustained(1.0, SLO_FACTOR * 2.0 + 1e-9, light)
    assert not sustained(1.0, 1.0, light, failed=1)
    assert not sustained(float("nan"), 1.0, light)   # no request finished: not sustained


def test_coarse_capacity_is_the_highest_rate_below_the_first_failure():
    assert coarse_capacity([(5.5, False), (4.25, True), (4.9, True)]) == (4.9, 5.5)
    # a later success above a failure does not count: the bracket stops at the first failure
    assert coarse_capacity([(3.0, True), (1.0, True), (2.0, False)]) == (1.0, 2.0)
    assert coarse_capacity([(2.0, True), (1.0, True)]) == (2.0, None)
    assert coarse_capacity([(1.0, False), (2.0, True)]) == (0.0, 1.0)


def test_layout_trace_replaces_every_nth_prompt_only():
    plain = trace_for("long", 1.0, 12, 0, 4)
    tailed = layout_trace("long", 1.0, 12, 0, 4, tail_every=5, tail_tokens=1_000_000)
    assert [r.prompt_tokens for r in tailed] == [
        1_000_000 if i in (4, 9) else r.prompt_tokens for i, r in enumerate(plain)]
    assert [r.arrival_time for r in tailed] == [r.arrival_time for r in plain]
    assert layout_trace("long", 1.0, 12, 0, 4) == plain


def _p(cfg, trace):
    t = np.asarray(simulate(cfg, trace)["ttft_s"])
    return float(np.percentile(t, 50)), float(np.percentile(t, 99))


@pytest.mark.parametrize("layouts", [("ring",), ("ring", "a2a")])
def test_sim_capacity_brackets_the_slo_on_the_deployments_trace(layouts):
    """On the emulated paper deployment and a 24-request Long trace, with a tight light-load
    reference (so the SLO bites inside the bracket): the rate returned is sustained when
    simulated again, and a probed rate within the tolerance above it is not."""
    base = load_deployment("paper-llama3-8b-emulated.toml")
    cfg = msgspec.structs.replace(base, sp_layout=SpLayoutConfig(layouts=layouts,
                                                                 ring_overlap=False))
    light = (0.08, 0.4)

    def trace_at(rate):
        return trace_for("long", rate, 24, 0, 4)

    cap, probes = sim_capacity(cfg, trace_at, light, lo=0.25, hi=16.0, tol=0.1)
    assert 0.25 <= cap < 16.0
    assert sustained(*_p(cfg, trace_at(cap)), light)
    above = [r for r, _p50, _p99, good in probes if cap < r <= cap + 0.1 and not good]
    assert above, probes
    assert not sustained(*_p(cfg, trace_at(above[0])), light)
    # a reference no run can meet: nothing sustained; one every run meets: the cap
    assert sim_capacity(cfg, trace_at, (1e-6, 1e-6), lo=0.25, hi=16.0, tol=0.1)[0] == 0.0
    assert sim_capacity(cfg, trace_at, (1e3, 1e3), lo=0.25, hi=16.0, tol=0.1)[0] == 16.0
