"""The emulated executor waits what the simulator runs: Eq. 1, plus the delta on non-ring chunks."""

from __future__ import annotations

import msgspec
import pytest
from tetris.actors.prefill.executor import EmulatedExecutor
from tetris.actors.prefill.layout import forced_plan, plan_layout
from tetris.actors.prefill.messages import ChunkTask

from tetris.scheduler.latency import load_profile


def test_an_a2a_chunk_waits_eq1_plus_its_delta_a_ring_chunk_eq1():
    profile = load_profile("a100-llama3-8b-tp1")
    plan = forced_plan("e", 3000, "1000x1,restx2:a2a", (0, 0), num_kv_heads=8)
    lay = plan_layout(plan)[0][1]
    task = ChunkTask(request_id="e", chunk_index=1, num_chunks=2, seq=0, group=lay.group,
                     rank=1, chunk_start=1000, chunk_end=3000, prompt_tokens=3000,
                     chunk_positions=lay.chunk_positions, history=lay.history, moves=lay.moves,
                     sp_layout=plan.chunks[1].sp_layout, sp_layout_delta_s=-0.004)
    waits = []
    ex = EmulatedExecutor(profile, sleep=waits.append, clock=lambda: 0.0)
    ex.execute(task)
    ex.execute(msgspec.structs.replace(task, sp_layout="ring", sp_layout_delta_s=0.0))
    # a ring on links other than Eq. 1's fitted ones carries its correction (layout_policy.py)
    ex.execute(msgspec.structs.replace(task, sp_layout="ring", sp_layout_delta_s=0.003))
    eq1 = profile.predict(2, 1000, 2000)
    assert waits == [pytest.approx(eq1 - 0.004), pytest.approx(eq1), pytest.approx(eq1 + 0.003)]
