"""The emulated executor: same actor and control path, duration from the latency profile."""

from __future__ import annotations

import time

import msgspec
import pytest

from tetris.actors.executor import EmulatedExecutor
from tetris.actors.layout import forced_plan, plan_layout
from tetris.actors.prefill_messages import ChunkTask
from tetris.config import load_deployment
from tetris.scheduler.latency import load_profile

PROFILE = "a100-llama3-8b-tp1"


def test_emulated_chunk_waits_the_predicted_time():
    profile = load_profile(PROFILE)
    plan = forced_plan("e", 3000, "1000x1,restx2", (0, 0))
    layouts, _ = plan_layout(plan)
    lay = layouts[1]
    task = ChunkTask(request_id="e", chunk_index=1, num_chunks=2, seq=0, group=lay.group,
                     rank=1, chunk_start=1000, chunk_end=3000, prompt_tokens=3000,
                     chunk_positions=lay.chunk_positions, history=lay.history, moves=lay.moves)
    ex = EmulatedExecutor(profile)
    ex.prepare(task)
    t0 = time.perf_counter()
    res = ex.execute(task)
    took = time.perf_counter() - t0
    predicted = profile.predict(2, 1000, 2000)
    assert res.emulated and res.first_token is None and res.instance == 1
    assert predicted <= took < predicted + 0.25


@pytest.mark.ray
def test_emulated_pool_runs_plans_through_the_same_actors(ray_session):
    from tetris.actors.prefill_pool import PrefillPool

    cfg = load_deployment("tiny-cpu.toml")
    cfg = msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, executor="emulated"))
    pool = PrefillPool(cfg, num_instances=2, node_size=2, profile=PROFILE, timeout_s=10.0)
    try:
        plan = forced_plan("emu", 3000, "1000x1,restx2", pool.node_of)
        res = pool.run(plan, [1] * 3000)
        profile = load_profile(PROFILE)
        expect = [profile.predict(1, 0, 1000), profile.predict(2, 1000, 2000)]
        # The member holding the last prompt token answers with the placeholder token.
        from tetris.actors.emulated_decode import PLACEHOLDER_TOKEN

        assert res.emulated and res.first_token == PLACEHOLDER_TOKEN
        for got, want in zip(res.chunk_elapsed_s, expect):
            assert want <= got < want + 0.25
        pool.workers[1].set_fault.remote("bad", 0, 0)
        from tetris.actors.prefill_messages import PrefillError

        with pytest.raises(PrefillError, match="prefill instance 1"):
            pool.run(forced_plan("bad", 100, "100x2", pool.node_of), [1] * 100)
        assert pool.run(forced_plan("ok", 100, "100x2", pool.node_of), [1] * 100).emulated
    finally:
        pool.shutdown()
