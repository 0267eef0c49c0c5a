"""``tetris serve`` refuses bad options before it starts Ray."""

from __future__ import annotations

import pytest

from tetris.cli.main import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-pending", "0"], "--max-pending must be positive"),
    (["--prefill-check-s", "-1"], "--prefill-check-s must be >= 0"),
    (["--prefill-check-s", "nan"], "--prefill-check-s must be >= 0"),
])
def test_bad_options_are_refused_before_anything_starts(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err
