"""The scheduler, the control plane and the simulator load without torch and Ray, for real.

The static rules (every import statement, lazy ones too) are ``tests/test_layering.py``; this
imports the modules in a fresh interpreter and looks at ``sys.modules``.
"""

from __future__ import annotations

import subprocess
import sys


def test_scheduler_control_and_sim_import_neither_torch_nor_ray():
    code = ("import importlib, pkgutil, sys\n"
            "names = ['tetris.config', 'tetris.plan', 'tetris.sampling_params', 'tetris.token_ids',\n"
            "         'tetris.errors', 'tetris.cli.plan', 'tetris.cli.profile']\n"
            "for pkg in ('tetris.scheduler', 'tetris.control', 'tetris.sim'):\n"
            "    try:\n"
            "        mod = importlib.import_module(pkg)\n"
            "    except ModuleNotFoundError as e:\n"
            "        if e.name != pkg:\n"
            "            raise\n"
            "        continue   # a package not written yet\n"
            "    names += [pkg] + [f'{pkg}.{m.name}' for m in pkgutil.iter_modules(mod.__path__)]\n"
            "for name in names:\n"
            "    importlib.import_module(name)\n"
            "bad = sorted(m for m in ('torch', 'ray') if m in sys.modules)\n"
            "print(len(names), ','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, bad = out.stdout.split(" ", 1)
    assert int(count) > 20 and bad.strip() == ""
