import json

import msgspec
import numpy as np
import pytest

from tetris.cli.main import main
from tetris.scheduler.rate import ImprovementRateTable
from tetris.sim.experiments import RunSpec, capacity, light_load, make_requests, run_one
from tetris.sim.profiler import profile_rates, save_table
from tetris.sim.trace_export import chrome_trace


def test_tetris_plans_execute_as_planned_and_beat_fixed_sp16_under_load():
    base = RunSpec(workload="short", rate=4.0, requests=150, decode=False, improvement_rate=0.3)
    tetris, _ = run_one(base)
    fixed16, _ = run_one(msgspec.structs.replace(base, policy="fixed-sp-16"))
    assert tetris.max_plan_deviation_s < 1e-6
    assert tetris.mean_chunks > 1.0        # CDSP actually splits some requests
    assert tetris.ttft.p50 < fixed16.ttft.p50


def test_capacity_bisection_brackets_the_slo_crossing():
    base = RunSpec(workload="short", policy="fixed-sp-8", requests=120, decode=False)
    light = light_load("8b", "short", n=500)
    cap = capacity(base, seeds=[0], lo=0.5, hi=4.0, tol=0.25, light=light)
    ok = [p for p in cap.probes if p[3]]
    bad = [p for p in cap.probes if not p[3]]
    assert ok and bad and cap.capacity_rps == max(p[0] for p in ok)
    assert min(p[0] for p in bad) - cap.capacity_rps <= 0.25 + 1e-9
    for rate, p50, p99, good in cap.probes:
        assert good == (p50 <= 25 * light[0] and p99 <= 25 * light[1])


def test_profiler_table_drives_the_online_monitor(tmp_path):
    rates, best, grid = profile_rates("8b", "short", [0.5, 6.0], [0.05, 0.65], seeds=1, requests=80)
    assert len(grid) == 4 and all(b in (0.05, 0.65) for b in best)
    for r, b in zip(rates, best):  # the recorded θ really has the lowest mean TTFT at its rate
        pts = {g["theta"]: g["ttft_mean"] for g in grid if g["rate"] == r}
        assert pts[b] == min(pts.values())
    path = save_table(tmp_path / "t.toml", rates, best, model="8b", workload="short")
    table = ImprovementRateTable.load(path)
    spec = RunSpec(workload="short", rate=6.0, requests=400, decode=False, rate_table=str(path))
    res, _ = run_one(spec)
    assert res.improvement_rates[-1] == best[1]   # the monitor saw ~6 req/s and switched


def test_loongserve_never_plans_prefill_on_an_instance_while_it_decodes():
    spec = RunSpec(policy="loongserve", workload="short", rate=3.0, requests=60, record=True)
    res, sim = run_one(spec)
    assert res.tbt is not None and sim.max_reserved >= 1
    arrival = {r.request_id: r.arrival_time for r in sim.requests}
    for i, home in enumerate(sim.homes):
        req = sim.decode_reqs[i]
        assert req.finish_time >= req.ready_time >= req.first_token_time
        # no request that arrived while `home` held request i's KV may prefill on `home`
        t0, t1 = sim.requests[i].arrival_time, req.finish_time
        for run in sim.prefill.runs:
            if home in run.instances and run.request_id != req.request_id:
                assert not (t0 < arrival[run.request_id] < t1)
    assert sum(sim.assigned_count) == 0 and not any(sim.reserved)


def test_chrome_trace_has_one_event_per_chunk_member():
    spec = RunSpec(workload="short", rate=4.0, requests=30, decode=False, improvement_rate=0.3,
                   record=True)
    _, sim = run_one(spec)
    trace = chrome_trace(sim.prefill.runs, num_instances=16)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(len(r.instances) for r in sim.prefill.runs)
    assert all(e["dur"] > 0 for e in xs)


def test_cli_run_json_prints_one_object(capsys, tmp_path):
    rc = main(["sim", "run", "--json", "--policy", "fixed-sp-8", "--rate", "2", "--requests", "40",
               "--out", str(tmp_path)])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["policy"] == "fixed-sp-8" and obj["requests"] == 40 and obj["tbt"]["p50"] > 0
    assert (tmp_path / "schedule.png").stat().st_size > 1000
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_unknown_workload_is_a_clear_error():
    with pytest.raises(ValueError, match="does not exist"):
        make_requests("nope", 1.0, 10, 0)


def test_cli_output_mean_reaches_the_workload(capsys, monkeypatch):
    import tetris.sim.experiments as ex
    seen, real = [], ex.make_requests

    def spy(*a, **kw):
        reqs = real(*a, **kw)
        seen.append(np.mean([r.output_tokens for r in reqs]))
        return reqs

    monkeypatch.setattr(ex, "make_requests", spy)
    for mean in ("384", "2048"):
        assert main(["sim", "run", "--json", "--policy", "fixed-sp-8", "--rate", "2",
                     "--requests", "300", "--no-decode", "--output-mean", mean]) == 0
        capsys.readouterr()
    assert 300 < seen[0] < 470 and 1700 < seen[1] < 2400


def test_loongserve_peak_kv_is_the_true_peak_of_concurrent_decoding():
    from tetris.sim.loongserve import peak_kv
    rng = np.random.default_rng(3)
    for _ in range(200):
        items = [(int(c), int(r)) for c, r in zip(rng.integers(1, 50, 6), rng.integers(0, 30, 6))]
        # every request grows one token per step and frees its KV after its last one
        usage = [sum(c + min(t, r) for c, r in items if t <= r) for t in range(31)]
        assert peak_kv(items) == max(usage)
    assert peak_kv([]) == 0
    # worst case below the summed final sizes whenever requests finish at different times
    assert peak_kv([(100, 10), (100, 1)]) == 202 < 110 + 101


def test_loongserve_admission_holds_worst_case_kv_and_drains():
    spec = RunSpec(policy="loongserve", workload="short", rate=4.0, requests=80, output_mean=1024)
    res, sim = run_one(spec)
    assert res.tbt is not None and sim.max_reserved >= 2
    assert all(not d.pending and not d.running for d in sim.decoders)
    assert all(not np.isnan(r.finish_time) for r in sim.decode_reqs)


def test_profiled_table_does_not_depend_on_the_output_mean():
    # The profiler simulates prefill only, and arrivals and prompts are drawn before outputs:
    # the θ table made at one output mean serves every output mean.
    a = profile_rates("8b", "short", [3.0], [0.05, 0.45], seeds=1, requests=60, output_mean=384)
    b = profile_rates("8b", "short", [3.0], [0.05, 0.45], seeds=1, requests=60, output_mean=2048)
    assert a == b
    r384 = make_requests("short", 3.0, 60, 1000, 384)
    r2048 = make_requests("short", 3.0, 60, 1000, 2048)
    assert [(r.arrival_time, r.prompt_tokens) for r in r384] == \
        [(r.arrival_time, r.prompt_tokens) for r in r2048]
    assert np.mean([r.output_tokens for r in r2048]) > 3 * np.mean([r.output_tokens for r in r384])


def test_throughput_ceiling_bounds_fixed_sp_and_orders_policies():
    from tetris.sim.experiments import policy_sp_sizes, throughput_ceiling
    assert policy_sp_sizes("8b", "fixed-sp-8") == (8,)
    assert policy_sp_sizes("8b", "tetris") == (1, 2, 4, 8, 16)
    assert policy_sp_sizes("70b", "tetris") == (1, 2, 4, 8)
    assert policy_sp_sizes("8b", "loongserve") is None
    c8 = throughput_ceiling("8b", "long", (8,), n=2000)
    c1 = throughput_ceiling("8b", "long", (1,), n=2000)
    call = throughput_ceiling("8b", "long", (1, 2, 4, 8, 16), n=2000)
    # The best size per request is at least as good as any single one; SP 1 is close to it.
    assert call >= c1 > c8 and call < 1.01 * c1
    # Fixed SP 8 below its ceiling keeps up; well above it the backlog, hence TTFT, grows.
    under = run_one(RunSpec(model="8b", workload="long", policy="fixed-sp-8", rate=0.8 * c8,
                            requests=300, decode=False))[0].ttft_s
    over = run_one(RunSpec(model="8b", workload="long", policy="fixed-sp-8", rate=1.3 * c8,
                           requests=300, decode=False))[0].ttft_s
    assert np.mean(under[-100:]) < 2 * np.mean(under[:100])
    assert np.mean(over[-100:]) > 3 * np.mean(over[:100])
    with pytest.raises(ValueError):
        throughput_ceiling("70b", "long", (16,))
