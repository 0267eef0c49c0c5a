"""``tetris bench chaos``: the pure parts, and one short EMULATION run with a prefill worker and
a decode rank killed under load."""

from __future__ import annotations

import argparse
import json

import pytest

from tetris.bench.chaos import kill_schedule, plot_chaos, retries_by_stage, stages
from tetris.cli.bench_chaos import add_args, run

from test_soak import _reduced as reduced_config   # the emulated 8B cluster, cut down


def test_kills_come_every_period_in_turn_and_stop_with_the_load():
    assert kill_schedule(100, 30) == [(30, "prefill"), (60, "decode"), (90, "prefill")]
    assert kill_schedule(90, 30) == [(30, "prefill"), (60, "decode")]   # none as the load ends
    assert kill_schedule(50, 10, ("decode",)) == [(10, "decode"), (20, "decode"), (30, "decode"),
                                                  (40, "decode")]
    with pytest.raises(ValueError, match="kill targets are prefill, decode; got ranks"):
        kill_schedule(50, 10, ("ranks",))
    with pytest.raises(ValueError, match="positive"):
        kill_schedule(50, 0)


def test_retries_are_read_per_stage_from_the_dispatchers_metrics():
    text = "\n".join([
        "# HELP tetris:request_retries_total Requests run again ...",
        'tetris:request_retries_total{model_name="m",stage="decode"} 3.0',
        'tetris:request_retries_total{model_name="m",stage="prefill"} 1.0',
        'tetris:request_retries_created{model_name="m",stage="prefill"} 1.7e9',
        'tetris:decode_instance_restarts_total{instance="0",model_name="m"} 1.0'])
    assert retries_by_stage(text) == {"decode": 3, "prefill": 1}
    assert retries_by_stage("") == {}


def _timeline(rid, arrival, start, end, first_output, retries=0, decode_instance=1):
    return {"request_id": rid, "arrival": arrival, "prefill_start": start, "prefill_end": end,
            "first_output": first_output, "retries": retries, "decode_instance": decode_instance,
            "breakdown": {"queue_s": start - arrival, "prefill_s": end - start,
                          "handoff_s": first_output - end, "ttft_s": first_output - arrival}}


def test_stages_split_each_ttft_in_paper_time_in_arrival_order():
    records = [{"request_id": "b", "arrival_s": 4.0}, {"request_id": "a", "arrival_s": 1.0},
               {"request_id": "refused", "arrival_s": 2.0}, {"request_id": "lost", "arrival_s": 3.0}]
    timelines = [_timeline("a", 100.0, 104.0, 106.0, 107.0),
                 _timeline("b", 200.0, 201.0, 211.0, 0.0, retries=2),   # no decode output yet
                 {"request_id": "lost", "prefill_end": 0.0, "retries": 1, "decode_instance": 0}]
    # time scale 2: wall seconds of the dispatcher halve into paper seconds
    assert stages(records, timelines, 2.0) == [[1.0, 2.0, 1.0, 0.5, 0, 1],
                                               [2.0, None, None, None, None, None],
                                               [3.0, None, None, None, 1, 0],
                                               [4.0, 0.5, 5.0, None, 2, 1]]


def test_the_plot_marks_kills_and_failed_requests(tmp_path):
    run_ = {"requests": [[0.5, 0.2, True], [9.0, 3.5, True], [9.5, None, False]],
            "kills": [{"t_s": 8.0, "kind": "prefill", "target": "PrefillWorker[1]"}]}
    out = {"workload": "short", "load": 0.5, "time_scale": 2.0,
           "runs": {"baseline": {"requests": [[0.5, 0.2, True], [9.0, 0.3, True], [9.5, 0.2, True]],
                                 "kills": []}, "faults": run_}}
    path = plot_chaos(out, tmp_path / "sub" / "chaos.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    run_["stages"] = [[0.5, 0.1, 0.1, 0.05, 0, 0], [9.0, 3.0, 0.4, 0.1, 1, 1],
                      [9.5, None, None, None, 2, 0]]
    split = plot_chaos(out, tmp_path / "split.png")   # a second panel: taller
    assert split.stat().st_size > path.stat().st_size


@pytest.mark.timeout(400)
def test_killed_workers_heal_and_no_request_fails(serve_http, tmp_path):
    p = argparse.ArgumentParser()
    add_args(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(["--config", reduced_config(tmp_path, 2), "--capacity", "1.0", "--load", "0.8",
                         "--duration", "24", "--kill-every", "8", "--max-output", "8",
                         "--drain-timeout", "120", "--seed", "3", "--json",
                         "--plot", str(tmp_path / "chaos.png")])
    out = json.loads(json.dumps(run(args)))
    assert out["emulation"] is True and "EMULATION" in out["label"]
    r = out["runs"]["faults"]
    assert [k["kind"] for k in r["kills"]] == ["prefill", "decode"]
    assert r["kills"][0]["target"] in ("PrefillWorker[0]", "PrefillWorker[1]")
    assert r["kills"][1]["target"] == "DecodeRank[0]"     # emulated: one actor per instance
    assert r["failed"] == 0, r["errors"]
    assert r["sent"] >= 10 and r["completed"] == r["sent"]
    assert r["decode_restarts"] == {"0": 1} or r["decode_restarts"] == {0: 1}
    # replaced when a chunk or the dispatcher's probe found it dead, whichever came first
    assert r["prefill_replacements"] == 1
    assert len(r["requests"]) == r["sent"] and all(ok and ttft > 0 for _a, ttft, ok in r["requests"])
    assert 0 <= r["requests"][0][0] <= r["requests"][-1][0] <= 24
    # every request's TTFT split into stages, the same requests in the same order
    assert [row[0] for row in r["stages"]] == [a for a, _t, _ok in r["requests"]]
    for (_a, ttft, _ok), (_a2, queue, prefill, handoff, retries, decode) in zip(r["requests"],
                                                                                 r["stages"]):
        assert queue >= 0 and prefill > 0 and retries >= 0 and decode == 0
        assert queue + prefill <= ttft * 1.5 + 0.5    # the client's TTFT includes the hops
    assert (tmp_path / "chaos.png").stat().st_size > 10_000 and out["plot"].endswith("chaos.png")
    assert r["decode_down_at_end"] == [] and r["held_zero"] is True
    assert out["verdict"]["passed"] is True
