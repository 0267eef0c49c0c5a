"""``tetris plan`` with a cached prefix: the decision line and the three options' TTFTs, and
the move's bytes and time when the holders are busy (``--cached-busy-s``)."""

from __future__ import annotations

import json

import pytest

from tetris.cli.main import main

ARGS = ["plan", "--pool", "8", "--node-size", "4", "--prompt-tokens", "65536",
        "--cached-tokens", "61440", "--cached-on", "0,1"]
PREFIX_BYTES = 61440 * 32 * 2 * 8 * 128 * 2   # LLaMA3-8B, the CLI's cost-model geometry


def _run(capsys, *extra):
    assert main([*ARGS, *extra]) == 0
    return capsys.readouterr().out


def test_busy_holders_show_a_move_with_its_bytes_and_time(capsys):
    out = json.loads(_run(capsys, "--cached-busy-s", "50", "--json"))
    pf = out["prefix"]
    assert pf["decision"] == "move" and pf["moved"] and pf["reason"] == ""
    assert pf["move_bytes"] == PREFIX_BYTES
    # holders on node 0, the group on node 1: each holder's half over a 25 GB/s NIC
    assert out["chunks"][0]["instances"] == [4, 5, 6, 7]
    assert pf["move_s"] == pytest.approx(PREFIX_BYTES / 2 / 25e9 + 10e-6)
    assert out["chunks"][0]["expected_start"] == pytest.approx(pf["move_s"])
    assert pf["ttfts"]["move"] == pytest.approx(out["ttft_estimate"])
    assert pf["ttfts"]["extend"] > 50.0 and pf["ttfts"]["recompute"] > out["ttft_estimate"]
    text = _run(capsys, "--cached-busy-s", "50")
    assert ("prefix cache: 61440 tokens cached on 0,1: move (placement auto; history 61440 "
            "tokens)") in text
    t = pf["ttfts"]
    assert (f"  move: TTFT {t['move']:.3f} s (move {PREFIX_BYTES / 1e9:.3f} GB in "
            f"{pf['move_s'] * 1e3:.3f} ms) <- chosen") in text
    assert f"  extend: TTFT {t['extend']:.3f} s\n" in text
    assert f"  recompute: TTFT {t['recompute']:.3f} s\n" in text


def test_free_holders_extend_and_a_running_source_cannot_move(capsys):
    out = json.loads(_run(capsys, "--placement", "move", "--cached-source-running", "--json"))
    assert out["chunks"][0]["instances"][:2] == [0, 1] and not out["prefix"]["moved"]
    text = _run(capsys, "--placement", "move", "--cached-source-running")
    assert ("extend (placement move; history 61440 tokens); move not possible (the source "
            "run is still prefilling)") in text
    assert "  move: the source run is still prefilling\n" in text
    assert f"  extend: TTFT {out['ttft_estimate']:.3f} s <- chosen" in text
