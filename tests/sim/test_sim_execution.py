"""Execution on the measurements: the simulated hardware runs Table 1, the scheduler plans with the fit."""

import math

import msgspec
import numpy as np
import pytest

from tetris.cli.main import main
from tetris.scheduler.execution import MeasuredLatency, execution_latency, measurements_path
from tetris.scheduler.latency import (LatencySample, PrefillLatencyModel, ProfileError,
                                      SpCoefficients, load_profile, read_table_csv)
from tetris.sim.experiments import RunSpec, execution_fn, light_load, run_one, throughput_ceiling

TABLE = "paper_table1_llama3_8b_a100.csv"


@pytest.fixture(scope="module")
def fit():
    return load_profile("a100-llama3-8b-tp1")


@pytest.fixture(scope="module")
def measured(fit):
    return MeasuredLatency(fit, read_table_csv(measurements_path(TABLE)))


def test_every_table1_cell_is_executed_at_its_measured_time(fit, measured):
    samples = read_table_csv(measurements_path(TABLE))
    assert len(samples) == 34
    for s in samples:
        assert measured(s.sp_size, 0, s.chunk_tokens) == pytest.approx(s.seconds, rel=1e-12)
        # ... which the fit does not reproduce exactly (up to 6.3% off)
    errs = [abs(fit.predict(s.sp_size, 0, s.chunk_tokens) / s.seconds - 1) for s in samples]
    assert 0.05 < max(errs) < 0.07


def test_between_rows_the_correction_is_log_linear_and_held_beyond_the_ends(fit, measured):
    # SP 8: measured / fit is 1/0.99996 at 8192 and 0.31/0.3283 at 16384 (the fit's +5.9% cell)
    r8k = 0.24 / fit.predict(8, 0, 8192)
    r16k = 0.31 / fit.predict(8, 0, 16384)
    mid = int(round(math.sqrt(8192 * 16384)))      # halfway in log(tokens)
    assert measured.ratio(8, mid) == pytest.approx(0.5 * (r8k + r16k), rel=1e-4)
    assert measured(8, 0, mid) == pytest.approx(fit.predict(8, 0, mid) * measured.ratio(8, mid))
    # below 4096 and above the last measured row the nearest end's ratio holds
    r4k = 0.21 / fit.predict(8, 0, 4096)
    assert measured.ratio(8, 256) == pytest.approx(r4k)
    r128k = 29.20 / fit.predict(1, 0, 131072)      # SP 1 ran out of memory at 262144
    assert measured(1, 0, 200_000) == pytest.approx(fit.predict(1, 0, 200_000) * r128k)


def test_a_chunk_with_history_is_the_fit_scaled_at_the_context_it_ends_at(fit, measured):
    for sp, h, l in [(1, 30_000, 2_000), (8, 100_000, 31_072), (16, 4096, 256)]:
        want = fit.predict(sp, h, l) * measured.ratio(sp, h + l)
        assert measured(sp, h, l) == pytest.approx(want)


def test_the_measured_hardware_never_gets_faster_with_more_tokens(fit, measured):
    for sp in fit.sp_sizes:
        for h in (0, 16_384, 65_536):
            t = [measured(sp, h, l) for l in range(256, 200_000, 257)]
            assert all(b > a for a, b in zip(t, t[1:])), (sp, h)


def test_measured_execution_needs_a_measurement_per_sp_size():
    model = PrefillLatencyModel([SpCoefficients(1, 0.01, 1e-5, 0.0, 0.0),
                                 SpCoefficients(2, 0.01, 5e-6, 0.0, 0.0)], name="two")
    with pytest.raises(ProfileError, match=r"SP sizes \[2\]"):
        MeasuredLatency(model, [LatencySample(1, 0, 4096, 0.05)])
    # samples with history are not used for the h = 0 correction
    with pytest.raises(ProfileError, match=r"SP sizes \[1, 2\]"):
        MeasuredLatency(model, [LatencySample(1, 1024, 4096, 0.05)])


def test_70b_has_no_measurements_and_an_unknown_execution_is_refused():
    with pytest.raises(ProfileError, match="derived"):
        execution_fn("70b", "measured")
    with pytest.raises(ValueError, match="profile, measured"):
        execution_latency("table", load_profile("a100-llama3-8b-tp1"), TABLE)
    with pytest.raises(ProfileError, match="no such measurement table"):
        measurements_path("no-such-table.csv")


def test_plans_are_made_on_the_fit_and_run_on_the_measurements():
    base = RunSpec(workload="long", rate=1.5, requests=120, decode=False, improvement_rate=0.3,
                   record=True)
    exact, _ = run_one(base)
    res, sim = run_one(msgspec.structs.replace(base, execution="measured"))
    assert exact.max_plan_deviation_s < 1e-6
    assert res.max_plan_deviation_s > 0.01          # the scheduler's belief is off, as on hardware
    run = execution_fn("8b", "measured")
    prev_end: dict[str, float] = {}
    for c in sim.prefill.runs:
        assert c.end - c.start == pytest.approx(run(len(c.instances), c.history_tokens, c.tokens))
        assert c.start >= prev_end.get(c.request_id, 0.0) - 1e-9   # chunks of a request in order
        prev_end[c.request_id] = c.end
    # no instance runs two chunks at once
    by_instance: dict[int, list[tuple[float, float]]] = {}
    for c in sim.prefill.runs:
        for i in c.instances:
            by_instance.setdefault(i, []).append((c.start, c.end))
    for spans in by_instance.values():
        spans.sort()
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(spans, spans[1:]))


def test_light_load_and_ceiling_follow_the_hardware():
    l_fit = light_load("8b", "long", n=300)
    l_meas = light_load("8b", "long", n=300, execution="measured")
    assert l_fit != l_meas and abs(l_meas[0] / l_fit[0] - 1) < 0.07
    # the fit's SP-8 times are fast on Long's lengths, so the measured SP-8 ceiling is lower
    c_fit = throughput_ceiling("8b", "long", (8,), n=2000)
    c_meas = throughput_ceiling("8b", "long", (8,), n=2000, execution="measured")
    assert c_meas < 0.99 * c_fit
    lengths = [r for r in range(4096, 190_000, 997)]
    run = execution_fn("8b", "measured")
    assert np.mean([run(8, 0, n) for n in lengths]) > np.mean([run(8, 0, n) / run.ratio(8, n)
                                                               for n in lengths])


def test_cli_capacity_takes_the_execution(capsys):
    import json
    assert main(["sim", "capacity", "--workload", "short", "--requests", "60", "--policy",
                 "fixed-sp-8", "--no-decode", "--tol", "0.5", "--execution", "measured",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["execution"] == "measured" and out["capacities"][0]["capacity_rps"] > 0
    with pytest.raises(SystemExit):
        main(["sim", "run", "--execution", "table"])


def test_cli_says_a_bad_argument_in_one_line_and_exits_2(capsys):
    assert main(["sim", "run", "--model", "70b", "--execution", "measured", "--requests", "5"]) == 2
    err = capsys.readouterr().err
    assert "tetris sim run: error: profile 'a100-llama3-70b-tp4' has no measurements" in err
    assert "Traceback" not in err
    assert main(["sim", "capacity", "--policy", "fixed-sp-99", "--requests", "5", "--json"]) == 2
    assert "SP sizes [99] do not fit the 8b pool" in capsys.readouterr().err


def test_profiling_on_the_measurements_never_replaces_a_shipped_table(tmp_path, capsys):
    from tetris.sim.experiments import rate_table_path

    shipped = rate_table_path("8b", "long").read_bytes()
    assert main(["sim", "profile-rate", "--workload", "long", "--execution", "measured",
                 "--rates", "1", "--thetas", "0.05,0.55", "--seeds", "1", "--requests", "40",
                 "--json"]) == 2
    assert "--rate-table" in capsys.readouterr().err
    assert rate_table_path("8b", "long").read_bytes() == shipped
    out = tmp_path / "oracle.toml"
    assert main(["sim", "profile-rate", "--workload", "long", "--execution", "measured",
                 "--rates", "1", "--thetas", "0.05,0.55", "--seeds", "1", "--requests", "40",
                 "--rate-table", str(out), "--json"]) == 0
    assert out.is_file() and rate_table_path("8b", "long").read_bytes() == shipped
