"""SIMULATION: a request larger than a decode instance's whole KV is refused at arrival (the live
system's 429 DecodeFull), counted in ``SimResult.refused``; the run goes on for the others,
exactly as without it."""

from __future__ import annotations

import json
import math

import msgspec

from tetris.cli.main import main
from tetris.sim.cluster import CLUSTERS
from tetris.sim.experiments import RunSpec, run_one
from tetris.sim.workload import SimRequest, save_trace

CAPACITY = CLUSTERS["70b"].kv_capacity_tokens(CLUSTERS["70b"].decode_tp)   # 447,998 tokens


def _requests(big: bool) -> list[SimRequest]:
    reqs = [SimRequest("r0", 0.0, 20_000, 100), SimRequest("r2", 2.0, 30_000, 100),
            SimRequest("r3", 2.5, 12_000, 64)]
    if big:   # one token over the capacity with its output
        reqs.insert(1, SimRequest("big", 1.0, CAPACITY - 99, 100))
    return reqs


def _spec() -> RunSpec:
    return RunSpec(model="70b", workload="trace", policy="tetris", improvement_rate=0.3,
                   rate=1.0, record=True)


def test_a_request_larger_than_a_decode_instance_is_refused_and_the_others_run_as_without_it():
    res, sim = run_one(_spec(), _requests(big=True))
    alone, _ = run_one(_spec(), _requests(big=False))
    assert res.refused == 1 and res.requests == 4 and alone.refused == 0
    assert math.isnan(res.ttft_s[1]) and sim.decode_reqs[1] is None
    assert [res.ttft_s[i] for i in (0, 2, 3)] == alone.ttft_s     # bit-identical
    assert res.ttft == alone.ttft and res.tbt == alone.tbt
    # nothing of it ran: no prefill chunk, no decode slot; nothing stays booked or routed
    assert [p.request_id for p in sim.plans] == ["r0", "r2", "r3"]
    assert all(c.request_id != "big" for c in sim.prefill.runs)
    assert all(v == 0 for v in sim.control.held().values())
    assert all(d.used_tokens == 0 and not d.waiting for d in sim.decoders)
    # throughput and per-request means are of the served requests
    assert res.throughput_rps == alone.throughput_rps
    assert res.mean_chunks == alone.mean_chunks and res.mean_sp == alone.mean_sp


def test_a_request_that_just_fits_is_served():
    reqs = _requests(big=False)
    reqs.insert(1, SimRequest("edge", 1.0, CAPACITY - 100, 100))
    res, sim = run_one(_spec(), reqs)
    assert res.refused == 0 and not math.isnan(res.ttft_s[1])
    assert sim.decode_reqs[1].kv_tokens == CAPACITY and not math.isnan(sim.decode_reqs[1].finish_time)


def test_every_request_refused_gives_a_result_not_a_crash():
    res, _ = run_one(_spec(), [SimRequest("a", 0.0, CAPACITY, 10),
                               SimRequest("b", 1.0, CAPACITY + 5, 10)])
    assert res.refused == 2 and all(math.isnan(t) for t in res.ttft_s)
    assert math.isnan(res.throughput_rps) and math.isnan(res.ttft.p50)


def test_loongserve_refuses_it_too_and_runs_the_others_as_without_it():
    spec = msgspec.structs.replace(_spec(), policy="loongserve")
    res, sim = run_one(spec, _requests(big=True))
    alone, _ = run_one(spec, _requests(big=False))
    assert res.refused == 1 and math.isnan(res.ttft_s[1]) and sim.decode_reqs[1] is None
    assert [res.ttft_s[i] for i in (0, 2, 3)] == alone.ttft_s and res.tbt == alone.tbt


def test_tetris_sim_run_reports_the_refused_request(tmp_path, capsys):
    trace = tmp_path / "big.csv"
    save_trace(_requests(big=True), trace)
    args = ["sim", "run", "--model", "70b", "--workload", str(trace), "--policy", "tetris",
            "--improvement-rate", "0.3", "--rate", "1"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["refused"] == 1 and out["requests"] == 4
    assert main(args) == 0
    assert "refused 1 of 4 requests" in capsys.readouterr().out
