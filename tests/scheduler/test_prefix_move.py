"""A cached prefix moved to a first group without its holders (issue #23 item 2, "move"):
its price on the links by hand, the choice among extend, move and recompute (θ only against
recompute), forced placements and their fallbacks, and the control plane offering a move
only once the source's prefill has finished."""

from __future__ import annotations

import math

import pytest

from tetris.control import ControlPlane, PrefillQueue
from tetris.control.prefix_index import PrefixIndex
from tetris.scheduler.latency import load_profile
from tetris.scheduler.policies import make_policy
from tetris.scheduler.pool import PoolState
from tetris.scheduler.prefix_move import PrefixMove
from tetris.scheduler.prefix_plan import plan_from_prefix
from tetris.scheduler.sp_comm import LLAMA3_8B, CommLinks

PROMPT, CACHED, H = 65536, 61440, (0, 1)
# LLaMA3-8B's KV of the prefix on one instance: layers x K,V x KV heads x head dim x 2 bytes
PREFIX_BYTES = CACHED * 32 * 2 * 8 * 128 * 2
FAST = CommLinks(240e9, 25e9, 10e-6, 2)


@pytest.fixture(scope="module")
def prof():
    return load_profile("a100-llama3-8b-tp1")


def _eq1(prof, sp, history, tokens):
    a, b, g, d = prof.table[sp]
    return a + tokens * (b + g * history + d * tokens)   # Eq. 1


def _hand_move_s(holders, receivers, node_of, intra, inter, latency=10e-6):
    """Each holder-receiver pair carries bytes/(|H||G|); every instance sends (receives) its
    same-node and cross-node pairs at once; the slowest instance decides."""
    pair = PREFIX_BYTES / (len(holders) * len(receivers))
    worst = 0.0
    for x, peers in [(h, receivers) for h in holders] + [(r, holders) for r in receivers]:
        near = sum(node_of[p] == node_of[x] for p in peers)
        worst = max(worst, near * pair / intra, (len(peers) - near) * pair / inter)
    return worst + latency


def _hand_ttft(prof, plan, floor):
    """Eq. 1 of each chunk, the first no earlier than ``floor``."""
    t = floor
    for c in plan.chunks:
        t = max(t, c.expected_start) + _eq1(prof, c.sp_size, c.history_tokens, c.tokens)
        assert c.expected_end == pytest.approx(t)
    return t


def _option(prof, queue, links=FAST, **kw):
    policy = kw.pop("policy", None) or make_policy("tetris", prof)
    pool = PoolState.uniform(8, 4, queue)
    return plan_from_prefix(policy, "r", PROMPT, 0.0, pool, cached_tokens=CACHED, holders=H,
                            source="doc", move=None if links is None
                            else PrefixMove(LLAMA3_8B, links), **kw), pool


def test_the_move_price_is_the_slowest_instance_over_both_link_kinds():
    move = PrefixMove(LLAMA3_8B, FAST)
    node_of = [0, 0, 0, 0, 1, 1, 1, 1]
    assert move.kv_bytes(CACHED) == PREFIX_BYTES
    # H on node 0 to G on node 1: each holder sends its half over its 25 GB/s NIC
    assert move.seconds(CACHED, H, (4, 5, 6, 7), node_of) == pytest.approx(
        PREFIX_BYTES / 2 / 25e9 + 10e-6)
    # all on node 0: the same halves over NVSwitch
    assert move.seconds(CACHED, H, (2, 3), node_of) == pytest.approx(
        PREFIX_BYTES / 2 / 240e9 + 10e-6)
    # G across both nodes: a holder's two cross-node quarters decide
    assert move.seconds(CACHED, H, (2, 3, 4, 5), node_of) == pytest.approx(
        _hand_move_s(H, (2, 3, 4, 5), node_of, 240e9, 25e9))
    # one receiver takes the whole prefix over its own NIC
    assert move.seconds(CACHED, H, (4,), node_of) == pytest.approx(PREFIX_BYTES / 25e9 + 10e-6)


def test_busy_holders_and_a_fast_link_move_the_prefix_to_a_free_group(prof):
    opt, pool = _option(prof, [50.0, 50.0] + [0.0] * 6)
    plan = opt.plan.validate(8)
    assert opt.decision == "move" and opt.reason == ""
    assert plan.cached_moved and plan.cached_instances == H and plan.cached_tokens == CACHED
    g = plan.chunks[0].instances
    assert not set(g) & set(H)
    move_s = _hand_move_s(H, g, pool.node_of, 240e9, 25e9)
    assert opt.move_s == pytest.approx(move_s) and opt.move_bytes == PREFIX_BYTES
    assert plan.chunks[0].expected_start >= move_s   # ready = now = 0
    assert plan.ttft_estimate == pytest.approx(_hand_ttft(prof, plan, move_s))
    # the holders' group would wait 50 s; recomputing 64K tokens takes seconds
    assert opt.ttfts["extend"] > 50.0
    assert plan.ttft_estimate < opt.ttfts["recompute"] < opt.ttfts["extend"]
    assert opt.other_ttft == opt.ttfts["recompute"]


def test_free_holders_extend_their_group(prof):
    opt, _ = _option(prof, [0.0] * 8)
    plan = opt.plan.validate(8)
    assert opt.decision == "extend" and not plan.cached_moved
    assert plan.chunks[0].instances[:2] == H
    assert plan.ttft_estimate == pytest.approx(_hand_ttft(prof, plan, 0.0))
    # the move pays its link time for the same compute
    assert opt.ttfts["extend"] < opt.ttfts["move"] < opt.ttfts["recompute"]


def test_a_slow_link_and_busy_holders_recompute(prof):
    slow = CommLinks(0.05e9, 0.05e9, 10e-6, 2)
    opt, pool = _option(prof, [50.0, 50.0] + [0.0] * 6, links=slow)
    assert opt.decision == "recompute" and opt.plan.cached_tokens == 0
    assert opt.plan == make_policy("tetris", prof).plan("r", PROMPT, 0.0, pool)
    # the move alone takes 80 s: each holder sends its half at 50 MB/s
    assert opt.move_s >= PREFIX_BYTES / 2 / 0.05e9
    best_cached = min(opt.ttfts["extend"], opt.ttfts["move"])
    assert best_cached - opt.ttfts["recompute"] > 0.3 * best_cached


def test_theta_guards_recompute_but_not_move_against_extend(prof):
    # A link at which the move's TTFT is about 1.2x recompute's: recompute is sooner but not
    # by θ = 0.3 of it, so the cached option stays (the same rule as before, SPEC §3).
    bw = PREFIX_BYTES / 2 / 2.585
    opt, pool = _option(prof, [50.0, 50.0] + [0.0] * 6, links=CommLinks(bw, bw, 10e-6, 2))
    assert opt.decision == "move"
    assert opt.ttfts["recompute"] < opt.ttfts["move"] < opt.ttfts["recompute"] / 0.7
    g = opt.plan.chunks[0].instances
    move_s = _hand_move_s(H, g, pool.node_of, bw, bw)
    assert opt.plan.ttft_estimate == pytest.approx(_hand_ttft(prof, opt.plan, move_s))


def test_forced_placements_take_their_option_where_possible(prof):
    busy = [50.0, 50.0] + [0.0] * 6
    ext, _ = _option(prof, busy, placement="extend")
    assert ext.decision == "extend" and ext.plan.chunks[0].instances[:2] == H
    assert ext.plan.ttft_estimate == ext.ttfts["extend"] > ext.ttfts["move"]
    mv, _ = _option(prof, [0.0] * 8, placement="move")
    assert mv.decision == "move" and mv.plan.validate(8).cached_moved
    assert mv.ttfts["move"] > mv.ttfts["extend"]
    rc, pool = _option(prof, [0.0] * 8, placement="recompute")
    assert rc.decision == "recompute" and rc.plan.cached_tokens == 0
    assert rc.plan == make_policy("tetris", prof).plan("r", PROMPT, 0.0, pool)


def test_a_forced_move_that_is_impossible_falls_back_and_says_why(prof):
    busy = [50.0, 50.0] + [0.0] * 6
    no_links, _ = _option(prof, busy, links=None, placement="move")
    assert no_links.decision == "recompute" and "no link model" in no_links.reason
    assert no_links.ttfts["move"] == math.inf
    assert no_links.unavailable["move"] == "no link model"
    running, _ = _option(prof, [0.0] * 8, placement="move", source_ready=False)
    assert running.decision == "extend" and "still prefilling" in running.reason
    # holders on the whole pool: nobody to move to
    policy = make_policy("tetris", prof)
    pool = PoolState.uniform(2, 2, [0.0, 0.0])
    whole = plan_from_prefix(policy, "r", 20000, 0.0, pool, cached_tokens=16000, holders=(1, 0),
                             source="s", placement="move", move=PrefixMove(LLAMA3_8B, FAST))
    assert whole.decision == "extend" and "free of the holders" in whole.reason


def test_a_forced_extend_no_profile_size_holds_falls_back(prof):
    # three holders and SP sizes 1 and 2: no first group can start with all three
    policy = make_policy("tetris", prof, sp_candidates=[1, 2])
    pool = PoolState.uniform(8, 4)
    opt = plan_from_prefix(policy, "r", PROMPT, 0.0, pool, cached_tokens=CACHED,
                           holders=(0, 1, 2), source="doc", placement="extend",
                           move=PrefixMove(LLAMA3_8B, FAST))
    assert opt.decision == "move" and "extend not possible" in opt.reason
    assert opt.ttfts["extend"] == math.inf
    assert not set(opt.plan.validate(8).chunks[0].instances) & {0, 1, 2}


def test_the_control_plane_moves_only_a_prefix_whose_prefill_has_finished(prof):
    index = PrefixIndex(block_tokens=512, capacity_blocks=64)
    cp = ControlPlane(make_policy("tetris", prof, sp_candidates=[1, 2]),
                      PrefillQueue([0, 0, 0, 0, 1, 1, 1, 1]), None, improvement_rate=0.3,
                      prefix_index=index, prefix_placement="move",
                      prefix_move=PrefixMove(LLAMA3_8B, FAST))
    doc = index.hashes(list(range(16384)))
    first = cp.plan("q1", 16384 + 300, 0.0, block_hashes=doc)
    cp.commit(first)
    early = cp.plan("q2", 16384 + 200, 0.1, block_hashes=doc)   # q1 is still prefilling
    assert early.cached_source == "q1" and not early.cached_moved
    assert "still prefilling" in cp.last_prefix.reason
    cp.finished("q2", 0.1)
    cp.prefill_done("q1", first.ttft_estimate)
    cp.prefix_cached("q1")
    late = cp.plan("q3", 16384 + 200, 10.0, block_hashes=doc).validate(8)
    assert late.cached_moved and late.cached_instances == first.instances
    assert not set(late.chunks[0].instances) & set(first.instances)
    assert late.chunks[0].expected_start >= 10.0 + cp.last_prefix.move_s


def test_a_moved_plan_may_grow_its_group_in_later_chunks(prof):
    # Holders busy, four free instances on their node, a second node free in 1 s: the moved
    # prefix's group runs a chunk until the larger group is free (Algorithm 3), then grows.
    pool = PoolState.uniform(16, 8, [60.0, 60.0] + [0.0] * 6 + [1.0] * 8)
    opt = plan_from_prefix(make_policy("tetris", prof), "r", 131072, 0.0, pool,
                           cached_tokens=16384, holders=H, source="doc",
                           move=PrefixMove(LLAMA3_8B, FAST))
    plan = opt.plan.validate(16)
    assert opt.decision == "move" and len(plan.chunks) == 2
    first, second = plan.chunks
    assert second.instances[:first.sp_size] == first.instances   # groups only grow
    assert not set(second.instances) & set(H)
    # all of the move on node 0: each holder sends its half of 16K tokens' KV over NVSwitch
    move_s = 16384 * 32 * 2 * 8 * 128 * 2 / 2 / 240e9 + 10e-6
    assert first.expected_start == pytest.approx(move_s) == pytest.approx(opt.move_s)
    assert plan.ttft_estimate == pytest.approx(_hand_ttft(prof, plan, move_s))
    assert second.expected_start == 1.0   # the second node is free


def test_a_layout_policy_plans_hits_from_the_cache_with_each_chunk_on_its_layout(prof):
    """With CSPS layouts on (the dispatcher's policy is then a ``LayoutPolicy``) a hit is
    planned from the cache as with the ring alone, each chunk then given its cheapest layout
    and re-timed (a moved plan's first group no earlier than the move lands); before, every
    hit was recomputed."""
    from tetris.config import SpLayoutConfig
    from tetris.scheduler.layout_policy import LayoutPolicy, assign_layouts, landed_pool
    from tetris.scheduler.sp_comm import LayoutChooser

    # the ring's transfers charged in full, pieces allowed: a2a/M beats the ring here
    cfg = SpLayoutConfig(layouts=("ring", "a2a", "sptp"), micro_partitions=(1, 2, 4),
                         ring_overlap=False)
    chooser = LayoutChooser.from_config(cfg, LLAMA3_8B)
    wrapped = LayoutPolicy(make_policy("tetris", prof), chooser, prof)
    for queue, decision in [([0.0] * 8, "extend"), ([30.0, 30.0] + [0.0] * 6, "move")]:
        bare, pool = _option(prof, queue)
        opt, _ = _option(prof, queue, policy=wrapped)
        assert bare.decision == opt.decision == decision
        assert opt.plan.cached_tokens == CACHED
        # the same search, then the layouts: exactly assign_layouts over the bare plan
        expect = assign_layouts(bare.plan, chooser, landed_pool(pool, bare.plan), 0.0, prof)
        assert opt.plan == expect
        assert opt.ttfts[decision] == expect.ttft_estimate
        assert any(c.sp_layout == "a2a" for c in opt.plan.chunks)
        assert opt.ttfts[decision] < bare.ttfts[decision]
        if decision == "move":
            assert opt.plan.chunks[0].expected_start >= bare.plan.chunks[0].expected_start
