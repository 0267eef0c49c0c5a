"""``tetris plan --cached-tokens``: the plan from a cached prefix and the latency model's pick."""

from __future__ import annotations

import json

from tetris.cli.main import main


def _plan(capsys, *extra):
    assert main(["plan", "--pool", "16", "--node-size", "8", "--prompt-tokens", "131072",
                 "--cached-tokens", "120000", "--cached-on", "3,4", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_idle_holders_extend_and_busy_holders_recompute(capsys):
    out = _plan(capsys)
    assert out["prefix"]["decision"] == "extend" and out["prefix"]["cached_tokens"] == 120000
    assert out["chunks"][0]["start"] == 120000 and out["chunks"][0]["instances"][:2] == [3, 4]
    assert out["ttft_estimate"] < out["prefix"]["other_option_ttft"]
    # (the source still prefilling: no move of the prefix, test_plan_prefix_move.py has it)
    busy = _plan(capsys, "--queue-times", ",".join(["60"] * 8 + ["0"] * 8),
                 "--cached-source-running")
    assert busy["prefix"]["decision"] == "recompute" and busy["chunks"][0]["start"] == 0
    assert busy["prefix"]["other_option_ttft"] > 60 > busy["ttft_estimate"]
    # once it has finished, moving the prefix to the free node beats computing it again
    moved = _plan(capsys, "--queue-times", ",".join(["60"] * 8 + ["0"] * 8))
    assert moved["prefix"]["decision"] == "move"
    assert moved["ttft_estimate"] < busy["ttft_estimate"]


def test_table_names_the_decision_and_missing_holders_fail(capsys):
    assert main(["plan", "--pool", "16", "--prompt-tokens", "131072",
                 "--cached-tokens", "120000", "--cached-on", "3,4"]) == 0
    assert "prefix cache: 120000 tokens cached on 3,4: extend" in capsys.readouterr().out
    assert main(["plan", "--pool", "16", "--prompt-tokens", "9000", "--cached-tokens", "64"]) == 2
    assert "--cached-on" in capsys.readouterr().err
