"""The scheduler is shared by the simulator and the live dispatcher: no torch, no ray."""

from __future__ import annotations

import subprocess
import sys


def test_scheduler_imports_neither_torch_nor_ray():
    code = ("import sys\n"
            "import tetris.scheduler.latency, tetris.scheduler.decode_latency, tetris.scheduler.pool\n"
            "import tetris.scheduler.extend, tetris.scheduler.cdsp, tetris.scheduler.policies\n"
            "import tetris.scheduler.router, tetris.scheduler.rate, tetris.cli.plan, tetris.cli.profile\n"
            "bad = sorted(m for m in ('torch', 'ray') if m in sys.modules)\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
