"""``tetris bench kunserve``: the SIMULATION side by side in one JSON object, the numbers the
simulator gives for the same seeded trace; the EMULATION is empty unless asked for."""

from __future__ import annotations

import json

import msgspec

from tetris.cli.main import main
from tetris.sim.kunserve import POLICIES, KunServeSim
from tetris.sim.kunserve_workload import burst_trace, load_profile, profile_path


def test_simulation_only_json_matches_the_simulator(capsys):
    argv = ["bench", "kunserve", "--instances", "2", "--kv-scale", "0.25", "--requests", "300",
            "--rate", "30", "--seed", "3", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["EMULATION"] == {} and list(out["SIMULATION"]) == list(POLICIES)
    mem, prof = load_profile(profile_path("qwen2.5-14b-tp1"))
    prof = msgspec.structs.replace(prof, instances=2)
    mem = msgspec.structs.replace(mem, kv_bytes=int(mem.kv_bytes * 0.25))
    assert out["kv_blocks"] == mem.kv_blocks
    for policy in POLICIES:
        trace = burst_trace(300, 30, seed=3, burst_at=0.3, burst_end=0.7)
        ref = KunServeSim(trace, mem, prof, policy).run()
        got = out["SIMULATION"][policy]
        assert got["mode"] == "SIMULATION"
        assert {k: got[k] for k in ref} == ref
