"""Consolidating a sharded request onto its master (tetris/control/consolidation.py, LoongServe
§1.5) on the paper's LLaMA3-8B decode side: decisions on both sides of each crossover."""

from __future__ import annotations

import math

import pytest

from tetris.control.consolidation import consolidation_cost
from tetris.control.elastic import ElasticConfig, ElasticPlacer, ExchangeModel
from tetris.scheduler.decode_latency import LLAMA3_8B, DecodeLatencyModel
from tetris.scheduler.router import DecodeRouter

MODEL = DecodeLatencyModel(LLAMA3_8B)
CAP = MODEL.kv_capacity_tokens(8)
EXCHANGE = ExchangeModel(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)


def _placed(step, master_room: int, holder_room: int, kv_tokens: int):
    """Two instances, a request placed over both (memory trigger) whose KV has arrived."""
    router = DecodeRouter([CAP, CAP])
    placer = ElasticPlacer(router, [CAP, CAP], step, 8, EXCHANGE,
                           ElasticConfig(enabled=True, spread_for_time=False))
    router.update(0, master_room, 1)
    router.update(1, holder_room, 1)
    group = placer.place("r", kv_tokens)
    placer.arrived("r")
    assert group.master == 0 and group.ranges[0].instance == 1
    return placer, group, group.ranges[0]


def test_with_free_reads_it_is_query_broadcast_against_moving_kv():
    # A step model in which reading KV costs nothing: only the exchange is saved, and the
    # crossover is the copy over one step's exchange (csps-notes §2.5), ~20.2 steps here.
    placer, group, small = _placed(lambda tp, b, ctx: 0.02, 1_000_000, 20_000, 1_010_000)
    placer.router.update(0, 500_000, 12)   # others finished on the master; 12 in its batch
    crossover = EXCHANGE.kv_move_time(small.tokens) / EXCHANGE.step_time(2)
    assert 20 < crossover < 21
    cost = consolidation_cost(placer, group, small)
    assert cost.gain_per_step == pytest.approx(12 * EXCHANGE.step_time(2))
    assert cost.break_even_steps == pytest.approx(crossover)   # the batch weighs both sides
    assert placer.consolidation("r", remaining_steps=20) is None
    assert placer.consolidation("r", remaining_steps=21) == small
    assert EXCHANGE.choose(20, small.tokens, 2) == "query"
    assert EXCHANGE.choose(21, small.tokens, 2) == "move_kv"


def test_a_slow_holder_makes_moving_pay_sooner():
    placer, group, small = _placed(MODEL.step_time, 1_000_000, 20_000, 1_010_000)
    # master: this request alone over ~1M tokens; holder: 64 requests over a full instance
    placer.router.update(0, CAP - 1_000_000, 1)
    placer.router.update(1, 200, 64)
    holder_step = MODEL.step_time(8, 64, CAP - 200)
    assert holder_step > 3 * MODEL.step_time(8, 1, 1_000_000)
    cost = consolidation_cost(placer, group, small)
    # the lockstep: the master's step is the holder's plus the exchange
    assert cost.master_step == pytest.approx(holder_step + EXCHANGE.step_time(2))
    assert cost.master_step_after == pytest.approx(MODEL.step_time(8, 1, 1_000_000 + small.tokens))
    # far sooner than the exchange alone would pay for the copy (20.2 steps)
    assert cost.break_even_steps < 1
    assert placer.consolidation("r", remaining_steps=0) is None
    assert placer.consolidation("r", remaining_steps=1) == small
    assert EXCHANGE.choose(1, small.tokens, 2) == "query"
    # a holder lighter than the master: the master's step no longer waits for it, the range's
    # reads move from the holder's batch of 1 to the master's (the same time in this
    # roofline), so only the exchange is saved: back to the 20.2-step crossover
    placer.router.update(1, CAP - 500_000, 1)
    cost = consolidation_cost(placer, group, small)
    assert cost.break_even_steps == pytest.approx(
        EXCHANGE.kv_move_time(small.tokens) / EXCHANGE.step_time(2), rel=1e-6)
    n = math.floor(cost.break_even_steps)
    assert placer.consolidation("r", remaining_steps=n) is None
    assert placer.consolidation("r", remaining_steps=n + 1) == small


def test_a_loaded_master_keeps_asking_q_however_long_the_request():
    placer, group, big = _placed(MODEL.step_time, 1_300_000, 1_000_000, 2_000_000)
    assert big.tokens == 869_565
    # master: 100 requests over 3.27M tokens; holder: nothing of its own
    placer.router.update(0, 1_000_000, 100)
    placer.router.update(1, CAP - big.tokens, 0)
    cost = consolidation_cost(placer, group, big)
    # reading 870K more tokens slows the master's 100 rows more than the exchange and the
    # idle holder's reads cost them
    assert cost.master_step_after > cost.master_step
    assert cost.gain_per_step < 0 and cost.break_even_steps == math.inf
    assert placer.consolidation("r", remaining_steps=10_000_000) is None
    # the exchange alone would have moved it
    assert EXCHANGE.choose(10_000_000, big.tokens, 2) == "move_kv"
