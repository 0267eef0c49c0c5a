"""``tetris bench fidelity``: a tiny EMULATION run, live app and simulator on one seeded trace."""

from __future__ import annotations

import json

import pytest

from tetris.bench.fidelity import simulate, trace_for
from tetris.config import load_deployment


def _trace(tmp_path) -> str:
    path = tmp_path / "trace.csv"
    path.write_text("request_id,arrival_time,prompt_tokens,output_tokens\n"
                    "a,0.0,6000,4\nb,0.5,2500,3\nc,1.0,9000,50\n")
    return str(path)


def test_trace_is_seeded_rescaled_and_capped(tmp_path):
    a = trace_for("short", 2.0, 20, 3, 16)
    assert a == trace_for("short", 2.0, 20, 3, 16)
    assert max(r.output_tokens for r in a) <= 16 and len(a) == 20
    t = trace_for(_trace(tmp_path), 4.0, 3, 0, 8)
    assert [r.output_tokens for r in t] == [4, 3, 8]
    assert t[-1].arrival_time == pytest.approx(0.5)     # 2 gaps at 4 req/s


def test_simulated_ttft_of_a_lone_request_is_the_profile_time(tmp_path):
    from tetris.scheduler.latency import load_profile

    cfg = load_deployment("paper-llama3-8b-emulated.toml")
    trace = trace_for(_trace(tmp_path), 0.01, 1, 0, 4)
    out = simulate(cfg, trace)
    profile = load_profile("a100-llama3-8b-tp1")
    # An idle pool: the TTFT is the plan's compute alone, between the fastest SP size and SP 1
    # (θ = 0.3 takes a larger group only for a 30% gain).
    best = min(profile.predict(s, 0, 6000) for s in (1, 2, 4, 8, 16))
    assert best * 0.9999 <= out["ttft_s"][0] <= profile.predict(1, 0, 6000) * 1.0001
    assert len(out["decision_s"]) == 1 and out["decision_s"][0] > 0
    (plan,) = out["plans"]   # the plan the simulator ran, for the per-request comparison
    assert plan["ttft_estimate_s"] == pytest.approx(out["ttft_s"][0], rel=1e-6)
    assert plan["sp_sizes"] and all(s in (1, 2, 4, 8, 16) for s in plan["sp_sizes"])


def test_the_simulated_side_runs_the_measurements_the_workers_wait(tmp_path):
    import msgspec

    from tetris.scheduler.latency import load_profile
    from tetris.scheduler.execution import execution_latency

    table = "paper_table1_llama3_8b_a100.csv"
    cfg = load_deployment("paper-llama3-8b-emulated.toml")
    cfg = msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, emulated_measurements=table))
    trace = trace_for(_trace(tmp_path), 0.01, 1, 0, 4)
    out = simulate(cfg, trace)
    (plan,) = out["plans"]
    (sp,) = plan["sp_sizes"]      # 6000 tokens alone: one chunk
    measured = execution_latency("measured", load_profile("a100-llama3-8b-tp1"), table)(sp, 0, 6000)
    assert out["ttft_s"][0] == pytest.approx(measured, rel=1e-9)
    assert abs(plan["ttft_estimate_s"] / measured - 1) > 1e-3   # the plan was made on the fit


@pytest.mark.timeout(400)
def test_tiny_fidelity_run_prints_one_json_object(serve_http, tmp_path, capsys):
    from tetris.cli.main import main

    cfg = tmp_path / "tiny.toml"
    cfg.write_text(load_deployment("paper-llama3-8b-emulated.toml").source_path and
                   open(load_deployment("paper-llama3-8b-emulated.toml").source_path).read()
                   .replace("num_instances = 16", "num_instances = 4")
                   .replace("node_size = 8", "node_size = 2")
                   .replace("sp_candidates = [1, 2, 4, 8, 16]", "sp_candidates = [1, 2, 4]")
                   .replace("num_instances = 2\ntp_size = 8", "num_instances = 1\ntp_size = 2")
                   .replace("num_backends = 16", "num_backends = 4")
                   .replace("pool_size = 16", "pool_size = 4"))
    rc = main(["bench", "fidelity", "--config", str(cfg), "--workload", _trace(tmp_path),
               "--rate", "2", "--requests", "3", "--max-output", "4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["emulation"] is True and "EMULATION" in out["label"]
    (run,) = out["runs"]
    assert run["failed"] == 0 and run["requests"] == 3
    # Live TTFT adds the control plane and the hand-off to the same emulated compute, so it
    # cannot beat the simulator's (how far above it lies depends on this machine's load: the
    # fidelity figures come from the benchmark, not from this test).
    assert run["live_ttft_s"]["p50"] >= run["sim_ttft_s"]["p50"] * 0.98
    assert run["live_prefill_end_ttft_s"]["p50"] <= run["live_ttft_s"]["p50"]
    assert run["ratio_p50"] == pytest.approx(run["live_ttft_s"]["p50"] / run["sim_ttft_s"]["p50"])
    cp = run["control_plane"]
    assert cp["decision_us_mean"] > 0 and cp["ray_calls_per_request"]["transfer_control"] > 0
    assert cp["transfer_messages_per_request"]["in:Handshake"] >= 1
    pr = run["per_request"]
    assert pr["same_plan"] + pr["other_plan"] == 3 and len(pr["rows"]) == 3
    for row in pr["rows"]:
        assert row["live_sp_sizes"] and row["sim_sp_sizes"]
        assert row["live_queue_s"] >= 0 and row["live_ttft_s"] >= row["live_queue_s"]


def test_prefill_overrun_is_measured_from_the_planning_instant():
    """The plan's TTFT estimate is a duration from when it was planned; the overrun is how much
    later than that the prefill really ended (monotonic clock values are large: a mix-up of the
    two shows as hours)."""
    from tetris.bench.fidelity_live import LiveCluster

    tl = lambda rid, planned, est, end: dict(request_id=rid, arrival=planned - 0.01, planned=planned,
                                             ttft_estimate=est, prefill_end=end, first_output=end + 0.02,
                                             sp_sizes=[1])
    timelines = [tl("a", 19_000.0, 0.5, 19_000.7), tl("b", 19_001.0, 1.0, 19_001.9)]
    out = [dict(i=i, request_id=r, ttft=0.1, error=None, lag=0.0) for i, r in enumerate("ab")]
    got = LiveCluster._collect(None, [0, 1], out, {}, {}, timelines, 1.0)
    assert got["overrun_s"] == pytest.approx([0.2, -0.1])
    assert got["prefill_ttft_s"] == pytest.approx([0.71, 0.91])
