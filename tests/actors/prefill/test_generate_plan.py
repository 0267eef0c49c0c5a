"""``tetris generate --plan``: CDSP prefill on the pool, then the engine continues."""

from __future__ import annotations

import json

import pytest

from tetris.cli.main import main

pytestmark = pytest.mark.ray


def _generate(capsys, *extra):
    rc = main(["generate", "--config", "tiny-cpu.toml", "--prompt", "ring attention " * 40,
               "--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--json", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_forced_plan_greedy_matches_plain_engine(ray_session, capsys):
    rc, plain, _ = _generate(capsys)
    assert rc == 0
    rc, planned, err = _generate(capsys, "--plan", "200x1,restx4")
    assert rc == 0
    a, b = json.loads(plain), json.loads(planned)
    assert b["token_ids"] == a["token_ids"] and b["prompt_tokens"] == a["prompt_tokens"]
    assert "chunk 1: [200, " in err and "instances [0, 1, 2, 3]" in err


def test_forced_plan_seeded_sampling_matches_plain_engine(ray_session, capsys):
    """The pool samples the first token, the engine the rest: both draw by (seed, position)."""
    seeded = ("--temperature", "1.2", "--seed", "9", "--max-tokens", "8")
    rc, plain, _ = _generate(capsys, *seeded)
    assert rc == 0
    rc, planned, _ = _generate(capsys, "--plan", "200x1,restx4", *seeded)
    assert rc == 0
    a, b = json.loads(plain), json.loads(planned)
    assert len(a["token_ids"]) == 8 and b["token_ids"] == a["token_ids"]


def test_bad_plan_is_a_clear_error(capsys):
    rc = main(["generate", "--prompt", "abc", "--plan", "2x1,9x2"])
    _, err = capsys.readouterr()
    assert rc == 2 and "--plan covers 11 tokens but the prompt has" in err
