"""EMULATION: prefix caching on emulated prefill workers. An emulated worker holds no KV, but
it keeps the positions a real store would hold (``actors/prefill/emulated_kv.py``), so a plan
from a cached prefix finds its copies, waits Eq. 1 for the suffix with the prefix as history
(as the simulator charges it), and nothing is left held once the runs are released."""

from __future__ import annotations

import msgspec
import pytest
from tetris.actors.prefill.emulated_kv import EmulatedHoldings, subtract_ranges
from tetris.actors.prefill.layout import forced_plan

from tetris.config import load_deployment
from tetris.plan import Chunk, PrefillPlan
from tetris.scheduler.latency import load_profile

PROFILE = "a100-llama3-8b-tp1"


def test_holdings_follow_balancing_and_copy_only_the_prefix():
    assert subtract_ranges(((0, 10), (20, 30)), ((5, 22), (25, 26))) == \
        ((0, 5), (22, 25), (26, 30))
    h = EmulatedHoldings()
    h.reserve("src", [(0, 100), (300, 400)])
    h.reserve("src", [(100, 150)])
    h.release("src", [(40, 60)])            # sent away by cache balancing
    assert h.ranges("src") == ((0, 40), (60, 150), (300, 400))
    assert h.copy_prefix("src", "run", 320) == ((0, 40), (60, 150), (300, 320))
    assert h.copy_prefix("gone", "run2", 320) == () and h.copy_prefix("src", "src", 10) == ()
    h.free("src")                            # the copy outlives its source
    assert h.requests() == ["run"] and h.ranges("run") == ((0, 40), (60, 150), (300, 320))
    h.free("run")
    assert h.requests() == []


@pytest.mark.ray
def test_an_emulated_run_from_a_cached_prefix_waits_for_its_suffix_only(ray_session):
    from tetris.actors.decode.emulated import PLACEHOLDER_TOKEN
    from tetris.actors.prefill.pool import PrefillPool

    from tetris.errors import PrefixMissing

    cfg = load_deployment("tiny-cpu.toml")
    cfg = msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, executor="emulated"))
    profile = load_profile(PROFILE)
    pool = PrefillPool(cfg, num_instances=4, node_size=2, profile=PROFILE, timeout_s=20.0)
    try:
        prefix, prompt = 64000, 64256   # margin of seconds for the timing bound below
        # The prefix is sharded by a two-chunk ring (balancing moves history between them).
        source = forced_plan("src", prefix, "8000x1,restx2", pool.node_of)
        pool.run(source, [1] * prefix)
        holders = source.instances
        group = holders + tuple(i for i in range(4) if i not in holders)
        plan = PrefillPlan("hit", prompt, (Chunk(prefix, prompt, group),), cached_tokens=prefix,
                           cached_instances=holders, cached_source="src").validate(4)
        res = pool.run(plan, [1] * prompt)
        assert res.emulated and res.first_token == PLACEHOLDER_TOKEN
        # Eq. 1 with the cached prefix as history, well under the whole prompt's time.
        suffix_s = profile.predict(len(group), prefix, prompt - prefix)
        uncached_s = profile.predict(len(group), 0, prompt)
        assert suffix_s * 4 < uncached_s
        assert suffix_s <= res.chunk_elapsed_s[0] < uncached_s
        held = pool.held_requests()
        assert sorted(i for i, reqs in held.items() if "hit" in reqs) == sorted(group)
        # A moved prefix (prefix_move.py): its positions go from the holders to {2, 3} alone,
        # which then hold [0, prefix) whole (a plan extending from them finds it).
        moved = PrefillPlan("moved", prompt, (Chunk(prefix, prompt, (2, 3)),),
                            cached_tokens=prefix, cached_instances=holders, cached_source="src",
                            cached_moved=True).validate(4)
        assert pool.run(moved, [1] * prompt).emulated
        held = pool.held_requests()
        assert sorted(i for i, reqs in held.items() if "moved" in reqs) == [2, 3]
        assert pool.run(PrefillPlan("moved2", prompt, (Chunk(prefix, prompt, (2, 3)),),
                                    cached_tokens=prefix, cached_instances=(2, 3),
                                    cached_source="moved").validate(4), [1] * prompt).emulated
        pool.release("src")                  # the run holds its own copy of the prefix
        second = PrefillPlan("hit2", prompt, (Chunk(prefix, prompt, group),),
                             cached_tokens=prefix, cached_instances=group,
                             cached_source="hit").validate(4)
        assert pool.run(second, [1] * prompt).emulated   # from the copy, spread over 4
        with pytest.raises(PrefixMissing):  # a source already freed is missing, as with KV
            pool.run(PrefillPlan("miss", prompt, (Chunk(prefix, prompt, group),),
                                 cached_tokens=prefix, cached_instances=holders,
                                 cached_source="src").validate(4), [1] * prompt)
        for run in ("hit", "hit2", "moved", "moved2"):
            pool.release(run)
        assert not any(pool.held_requests().values())
    finally:
        pool.shutdown()
