"""The decode side of prefix caching in the dispatcher, against in-process fakes of the pools
(no Ray): a completed run is kept on its decode instance; a conversation's next turn is routed
there and reserved with the plan's cached prefix copied from the kept run, and the prefill pool
told not to stream it; an instance that freed the run meanwhile refuses the copy and the turn
is reserved again with the prefix streamed; clearing the cache frees every kept run."""

from __future__ import annotations

import asyncio

import msgspec
from test_dispatcher_prefix import DOC, Decode, Prefill, _req, _run

from tetris.config import PrefixCacheConfig, load_deployment
from tetris.serve.dispatcher import Dispatcher
from tetris.serve.metrics import ServingMetrics


class KeepingPrefill(Prefill):
    def __init__(self) -> None:
        super().__init__()
        self.run_kw: dict[str, dict] = {}
        self.virtual: dict[str, int] = {}   # the router's virtual usage while each run prefills
        self.dispatcher = None

    async def run(self, plan, token_ids, sampling, kv_receivers, **kw):
        self.run_kw[plan.request_id] = kw
        if self.dispatcher is not None:
            self.virtual[plan.request_id] = sum(self.dispatcher.control.router.virtual)
        return await super().run(plan, token_ids, sampling, kv_receivers)


class KeepingDecode(Decode):
    def __init__(self, refuse_copies: bool = False) -> None:
        super().__init__()
        self.refuse_copies = refuse_copies
        self.reserves: list[tuple[str, dict]] = []
        self.dropped: list[tuple[int, str]] = []

    async def reserve(self, instance, request_id, prompt, sampling, generated=(), **kw):
        self.reserves.append((request_id, kw))
        if kw.get("prefix_from") and self.refuse_copies:
            raise ValueError(f"no kept KV of {kw['prefix_from']!r} holding the prompt's first "
                             f"{kw['prefix_tokens']} tokens here")

    async def drop_kept(self, instance, run_id):
        self.dropped.append((instance, run_id))


def _dispatcher(prefill, decode) -> Dispatcher:
    dep = msgspec.structs.replace(load_deployment(None), prefix_cache=PrefixCacheConfig(
        enabled=True, block_tokens=16, capacity_blocks=256, decode_runs=2))
    return Dispatcher(dep, prefill, decode, node_of=[0, 0, 1, 1], decode_capacities=[1 << 20],
                      metrics=ServingMetrics("tiny", requests=False))


Q1 = DOC + [700, 701, 702]        # 603 tokens: 37 whole blocks indexed (592 tokens)


def _turn2(first_outputs):
    return Q1 + list(first_outputs) + list(range(800, 840))


def test_a_second_turn_copies_its_prefix_on_decode_and_is_not_streamed():
    prefill, decode = KeepingPrefill(), KeepingDecode()
    d = _dispatcher(prefill, decode)
    prefill.dispatcher = d
    turn2 = []

    async def scenario():
        out1 = await _run(d, _req("t1", Q1))
        turn2.extend(_turn2(t for o in out1 for t in o.new_token_ids))
        await _run(d, _req("t2", turn2))
        await _run(d, _req("other", list(range(2000, 2100))))   # lets t1 go (2 an instance)
        return await d.prefix_cache(), await d.prefix_cache(clear=True)

    before, after = asyncio.run(scenario())
    assert decode.reserves == [("t1", {"keep": True}),
                               ("t2", {"keep": True, "prefix_from": "t1",
                                       "prefix_tokens": 592}),
                               ("other", {"keep": True})]
    assert prefill.plans["t2"].cached_tokens == 592
    assert prefill.run_kw == {"t1": {}, "t2": {"prefix_streamed": False}, "other": {}}
    assert (before["decode_reuses"], before["decode_reused_tokens"]) == (1, 592)
    # the router books a run's prompt and output (max_tokens 2); t2's 37 blocks shared with
    # t1 (592 tokens, whole 16-token blocks) are counted used on the instance already
    assert prefill.virtual["t1"] == len(Q1) + 2
    assert prefill.virtual["t2"] == len(turn2) + 2 - 592
    assert before["decode_kept"] == {0: ["other", "t2"]}
    # t1 let go when "other" completed, the rest when the cache was cleared
    assert decode.dropped == [(0, "t1"), (0, "t2"), (0, "other")]
    assert after["decode_kept"] == {} and after["decode_kept_runs"] == 0


def test_a_refused_copy_falls_back_to_streaming_the_prefix():
    prefill, decode = KeepingPrefill(), KeepingDecode(refuse_copies=True)
    d = _dispatcher(prefill, decode)

    async def scenario():
        out1 = await _run(d, _req("t1", Q1))
        outs = await _run(d, _req("t2", _turn2(t for o in out1 for t in o.new_token_ids)))
        return outs, await d.prefix_cache()

    prefill.dispatcher = d
    outs, cache = asyncio.run(scenario())
    assert outs[-1].finished
    # the copy was refused: t2 streams its prefix and books its whole prompt
    assert prefill.virtual["t2"] == prefill.plans["t2"].prompt_tokens + 2
    assert [kw for rid, kw in decode.reserves if rid == "t2"] == [
        {"keep": True, "prefix_from": "t1", "prefix_tokens": 592}, {"keep": True}]
    assert prefill.run_kw["t2"] == {} and prefill.plans["t2"].cached_tokens == 592
    # the refusal says the instance freed t1: the dispatcher forgets it
    assert cache["decode_reuses"] == 0 and cache["decode_kept"] == {0: ["t2"]}
    assert d.held()["inflight"] == 0 and d.held()["prefix_refs"] == 0
