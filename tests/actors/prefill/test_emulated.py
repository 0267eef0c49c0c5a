"""The emulated executor: same actor and control path, duration from the latency profile."""

from __future__ import annotations

import time

import msgspec
import pytest

from tetris.actors.prefill.executor import EmulatedExecutor
from tetris.actors.prefill.layout import forced_plan, plan_layout
from tetris.actors.prefill.messages import ChunkTask
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
    from tetris.actors.prefill.pool import PrefillPool

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
        from tetris.actors.decode.emulated import PLACEHOLDER_TOKEN

        assert res.emulated and res.first_token == PLACEHOLDER_TOKEN
        for got, want in zip(res.chunk_elapsed_s, expect):
            assert want <= got < want + 0.25
        _turn_waits_are_timed(pool, profile)
        pool.workers[1].set_fault.remote("bad", 0, 0)
        from tetris.actors.prefill.messages import PrefillError

        with pytest.raises(PrefillError, match="prefill instance 1"):
            pool.run(forced_plan("bad", 100, "100x2", pool.node_of), [1] * 100)
        assert pool.run(forced_plan("ok", 100, "100x2", pool.node_of), [1] * 100).emulated
    finally:
        pool.shutdown()


def _turn_waits_are_timed(pool, profile) -> None:
    """``x`` runs 12k tokens alone on instance 1, committed first; ``a`` runs its first chunk
    on instance 0 at once, and its second, on both, must wait for ``x``: that wait is its
    ``turn_wait_s``, not compute; ``b``, on instance 0 behind ``a``, is ``queued_s``."""
    import threading

    from tetris.plan import Chunk, PrefillPlan

    x = PrefillPlan("x", 12_000, (Chunk(0, 12_000, (1,)),), policy="forced")
    a = PrefillPlan("a", 3000, (Chunk(0, 1000, (0,)), Chunk(1000, 3000, (0, 1))), policy="forced")
    b = PrefillPlan("b", 1000, (Chunk(0, 1000, (0,)),), policy="forced")
    for plan in (x, a, b):
        pool.commit(plan)
    got = {}
    threads = [threading.Thread(target=lambda p=p: got.__setitem__(p.request_id, pool.run(p, [1] * p.prompt_tokens)))
               for p in (b, a, x)]   # started in the opposite order: the tickets decide
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    t_x, t_a0, t_a1 = (profile.predict(1, 0, 12_000), profile.predict(1, 0, 1000),
                       profile.predict(2, 1000, 2000))
    assert got["x"].queued_s < 0.25 and got["x"].turn_wait_s == 0.0
    assert got["a"].queued_s < 0.25
    assert t_x - t_a0 - 0.05 <= got["a"].turn_wait_s < t_x - t_a0 + 0.3
    assert got["a"].elapsed_s == pytest.approx(t_a0 + got["a"].turn_wait_s + t_a1, abs=0.3)
    assert t_x + t_a1 - 0.05 <= got["b"].queued_s < t_x + t_a1 + 0.4   # behind a's second chunk
    assert got["b"].elapsed_s < profile.predict(1, 0, 1000) + 0.25


@pytest.mark.ray
def test_a_replacement_joins_a_new_world_while_a_long_chunk_runs_on_the_old(ray_session):
    """A dead worker's replacement does not wait for running chunks: every worker joins the
    next generation of the world beside its chunk (worker 0, busy for ~28 s, serves the new
    world's store too), the replacement serves at once next to a worker still on the old
    generation, and the old generation is dropped everywhere once its last chunk is done."""
    import threading

    import ray

    from tetris.actors.prefill.messages import PrefillWorkerLost
    from tetris.actors.prefill.pool import PrefillPool
    from tetris.plan import Chunk, PrefillPlan

    cfg = load_deployment("tiny-cpu.toml")
    cfg = msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, executor="emulated"))
    pool = PrefillPool(cfg, num_instances=3, node_size=3, profile=PROFILE, timeout_s=30.0)
    try:
        tokens = 130_000
        busy_s = load_profile(PROFILE).predict(1, 0, tokens)
        assert busy_s > 25
        long = PrefillPlan("long", tokens, (Chunk(0, tokens, (0,)),), policy="forced")
        pool.commit(long)
        out: dict = {}
        runner = threading.Thread(target=lambda: out.update(
            result=pool.run(long, [1] * tokens), end=time.monotonic()))
        runner.start()
        before, dead = pool.replacements, pool.workers[2]
        ray.kill(dead)
        time.sleep(0.5)
        with pytest.raises(PrefillWorkerLost, match="prefill instance 2"):
            pool.run(PrefillPlan("finds-it", 100, (Chunk(0, 100, (2,)),), policy="forced"), [1] * 100)
        deadline = time.monotonic() + busy_s
        while pool.replacements == before:
            assert time.monotonic() < deadline, "the replacement waited for the running chunk"
            time.sleep(0.1)
        assert runner.is_alive() and pool.workers[2] is not dead
        # the replacement serves in a ring with instance 1 while instance 0 is on the old world
        both = pool.run(PrefillPlan("new", 200, (Chunk(0, 200, (1, 2)),), policy="forced"), [1] * 200)
        assert both.emulated and runner.is_alive()
        runner.join(timeout=busy_s + 30)
        assert out["result"].emulated and out["result"].elapsed_s >= busy_s
        worlds = None
        for _ in range(50):   # the pool drops the old world without waiting for the workers
            worlds = ray.get([w.drop_worlds.remote(0) for w in pool.workers])
            if worlds == [[1]] * 3:
                break
            time.sleep(0.1)
        assert worlds == [[1]] * 3
    finally:
        pool.shutdown()


@pytest.mark.ray
def test_a_worker_found_dead_while_the_world_forms_is_replaced_too(ray_session):
    """Two workers die; a chunk finds one. Forming the new world with its replacement finds the
    other dead (its join fails): that one is replaced as well, the world forms with both, and
    every instance serves again. No replacement is lost on the way."""
    import ray

    from tetris.actors.prefill.messages import PrefillWorkerLost
    from tetris.actors.prefill.pool import PrefillPool
    from tetris.plan import Chunk, PrefillPlan

    cfg = load_deployment("tiny-cpu.toml")
    cfg = msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, executor="emulated"))
    pool = PrefillPool(cfg, num_instances=3, node_size=3, profile=PROFILE, timeout_s=30.0)
    try:
        before, old = pool.replacements, list(pool.workers)
        ray.kill(old[1])
        ray.kill(old[2])
        time.sleep(0.5)
        with pytest.raises(PrefillWorkerLost, match="prefill instance 2"):
            pool.run(PrefillPlan("finds-2", 100, (Chunk(0, 100, (2,)),), policy="forced"), [1] * 100)
        deadline = time.monotonic() + 180
        while pool.replacements < before + 2:
            assert time.monotonic() < deadline, f"replaced {pool.replacements - before} of 2"
            time.sleep(0.2)
        assert pool.workers[1] is not old[1] and pool.workers[2] is not old[2]
        assert pool.busy_for() == [0.0, 0.0, 0.0]
        res = pool.run(PrefillPlan("both", 300, (Chunk(0, 300, (1, 2)),), policy="forced"), [1] * 300)
        assert res.emulated and pool.worlds._ready == {}
    finally:
        pool.shutdown()


def _tenfold_table(path, profile):
    """A measurement table that says the hardware takes 10x the profile's prediction."""
    sizes = profile.sp_sizes
    lines = ["prompt_tokens," + ",".join(f"sp{s}" for s in sizes)]
    for n in (1000, 4000):
        lines.append(f"{n}," + ",".join(repr(10 * profile.predict(s, 0, n)) for s in sizes))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_emulated_chunk_waits_the_measured_time_when_given_measurements(tmp_path):
    from tetris.scheduler.execution import execution_latency

    profile = load_profile(PROFILE)
    timing = execution_latency("measured", profile, _tenfold_table(tmp_path / "m.csv", profile))
    waits = []
    ex = EmulatedExecutor(timing, sleep=waits.append, clock=lambda: 0.0)
    plan = forced_plan("m", 3000, "1000x1,restx2", (0, 0))
    lay = plan_layout(plan)[0][1]
    task = ChunkTask(request_id="m", chunk_index=1, num_chunks=2, seq=0, group=lay.group,
                     rank=1, chunk_start=1000, chunk_end=3000, prompt_tokens=3000,
                     chunk_positions=lay.chunk_positions, history=lay.history, moves=lay.moves)
    ex.execute(task)
    assert waits == [pytest.approx(10 * profile.predict(2, 1000, 2000))]


def test_emulated_measurements_need_the_emulated_executor():
    from tetris.config import PrefillConfig

    with pytest.raises(ValueError, match="needs prefill.executor = 'emulated'"):
        PrefillConfig(emulated_measurements="paper_table1_llama3_8b_a100.csv")
    assert PrefillConfig(executor="emulated",
                         emulated_measurements="paper_table1_llama3_8b_a100.csv").executor == "emulated"


def test_a_time_scaled_deployment_scales_its_measurements_alike(tmp_path):
    from tetris.bench.fidelity import scale_deployment
    from tetris.scheduler.execution import execution_latency

    cfg = load_deployment("paper-llama3-8b-emulated.toml")
    table = "paper_table1_llama3_8b_a100.csv"
    cfg = msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, emulated_measurements=table))
    scaled = scale_deployment(cfg, 4.0, tmp_path)
    assert scaled.prefill.emulated_measurements != table
    base = execution_latency("measured", load_profile(PROFILE), table)
    slow = execution_latency("measured", load_profile(scaled.scheduler.profile),
                             scaled.prefill.emulated_measurements)
    for sp, h, l in [(8, 0, 65536), (1, 0, 4096), (4, 20_000, 9000), (16, 0, 262144)]:
        assert slow(sp, h, l) == pytest.approx(4.0 * base(sp, h, l), rel=1e-9)
    assert slow(8, 0, 65536) == pytest.approx(4 * 1.37)      # Table 1's cell, slowed 4x


@pytest.mark.ray
def test_emulated_pool_waits_the_measurements_while_plans_use_the_profile(ray_session, tmp_path):
    from tetris.actors.prefill.pool import PrefillPool

    profile = load_profile(PROFILE)
    cfg = load_deployment("tiny-cpu.toml")
    cfg = msgspec.structs.replace(cfg, prefill=msgspec.structs.replace(
        cfg.prefill, executor="emulated",
        emulated_measurements=_tenfold_table(tmp_path / "m.csv", profile)))
    pool = PrefillPool(cfg, num_instances=2, node_size=2, profile=PROFILE, timeout_s=10.0)
    try:
        res = pool.run(forced_plan("meas", 3000, "1000x1,restx2", pool.node_of), [1] * 3000)
        want = [10 * profile.predict(1, 0, 1000), 10 * profile.predict(2, 1000, 2000)]
        for got, w in zip(res.chunk_elapsed_s, want, strict=True):
            assert w <= got < w + 0.25
    finally:
        pool.shutdown()
