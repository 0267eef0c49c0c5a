"""``tetris plan`` and ``tetris profile`` through the CLI entry point."""

from __future__ import annotations

import json

from tetris.cli.main import main


def test_plan_json_shows_the_hole_filling_chunk(capsys):
    queues = ",".join(["0.328"] * 8 + ["0"] * 8)
    rc = main(["plan", "--pool", "16", "--node-size", "8", "--queue-times", queues,
               "--prompt-tokens", "131072", "--improvement-rate", "0.3", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["sp_size"] for c in out["chunks"]] == [8, 16]
    assert out["chunks"][0]["instances"] == list(range(8, 16))
    assert out["chunks"][-1]["end"] == 131072
    best_single = min(o["ttft"] for o in out["single_chunk_options"])
    assert out["ttft_estimate"] < best_single
    assert out["single_chunk_choice"]["sp_size"] == 16


def test_plan_table_and_bad_input(capsys):
    assert main(["plan", "--pool", "8", "--node-size", "4", "--prompt-tokens", "20000",
                 "--policy", "fixed-sp-4"]) == 0
    text = capsys.readouterr().out
    assert "fixed-sp-4" in text and "TTFT estimate" in text
    assert main(["plan", "--pool", "8", "--queue-times", "1,2", "--prompt-tokens", "5"]) == 2
    assert "2 values for a pool of 8" in capsys.readouterr().err
    assert main(["plan", "--pool", "8", "--prompt-tokens", "5", "--policy", "nope"]) == 2


def test_profile_fit_prints_error_table_and_writes_profile(tmp_path, capsys):
    from importlib import resources

    csv = str(resources.files("tetris.configs").joinpath("profiles/paper_table1_llama3_8b_a100.csv"))
    out = tmp_path / "p.json"
    assert main(["profile", "fit", csv, "--out", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["cells"]) == 34 and res["max_relative_error"] < 0.07
    assert max(abs(c["relative_error"]) for c in res["cells"]) == res["max_relative_error"]
    assert main(["profile", "show", str(out)]) == 0
    assert "SP" in capsys.readouterr().out
    assert main(["profile", "fit", str(tmp_path / "missing.csv")]) == 2
