"""``tetris bench chaos``: the pure parts, and one short EMULATION run with a prefill worker and
a decode rank killed under load."""

from __future__ import annotations

import argparse
import json

import pytest

from tetris.bench_chaos import add_args, kill_schedule, retries_by_stage, run

from test_bench_soak import _reduced as reduced_config   # the emulated 8B cluster, cut down


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


@pytest.mark.timeout(400)
def test_killed_workers_heal_and_no_request_fails(serve_http, tmp_path):
    p = argparse.ArgumentParser()
    add_args(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(["--config", reduced_config(tmp_path, 2), "--capacity", "1.0", "--load", "0.8",
                         "--duration", "24", "--kill-every", "8", "--max-output", "8",
                         "--drain-timeout", "120", "--seed", "3", "--json"])
    out = json.loads(json.dumps(run(args)))
    assert out["emulation"] is True and "EMULATION" in out["label"]
    r = out["runs"]["faults"]
    assert [k["kind"] for k in r["kills"]] == ["prefill", "decode"]
    assert r["kills"][0]["target"] in ("PrefillWorker[0]", "PrefillWorker[1]")
    assert r["kills"][1]["target"] == "DecodeRank[0]"     # emulated: one actor per instance
    assert r["failed"] == 0, r["errors"]
    assert r["sent"] >= 10 and r["completed"] == r["sent"]
    assert r["decode_restarts"] == {"0": 1} or r["decode_restarts"] == {0: 1}
    assert r["prefill_replacements"] == 1 and r["retries"].get("prefill", 0) >= 1
    assert r["decode_down_at_end"] == [] and r["held_zero"] is True
    assert out["verdict"]["passed"] is True
