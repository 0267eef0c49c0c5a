"""Prefix caching in the dispatcher, against in-process fakes of the two pools (no Ray): the
second question about a document is planned from the first's KV, which the cache keeps past
hand-off and abort until the index lets it go; hits are counted and shown."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tetris.config import PrefixCacheConfig, load_deployment
from tetris.engine.request import OutputDelta
from tetris.errors import PrefixMissing
from tetris.sampling_params import SamplingParams
from tetris.serve.dispatcher import Dispatcher
from tetris.serve.metrics import ServingMetrics
from tetris.serve.protocol import GenerateRequest


class _Result(msgspec.Struct):
    first_token: int
    elapsed_s: float
    turn_wait_s: float = 0.0


class Prefill:
    def __init__(self, lost_sources=()) -> None:
        self.plans: dict[str, object] = {}
        self.released: list[str] = []
        self.aborted: list[str] = []
        self.lost_sources = set(lost_sources)   # their KV is gone (a worker was replaced)

    async def commit(self, plan, wait_replacing=False):
        return None

    async def busy_for(self):
        return None

    async def run(self, plan, token_ids, sampling, kv_receivers):
        self.plans[plan.request_id] = plan
        if plan.cached_source in self.lost_sources:
            raise PrefixMissing(f"{plan.cached_source} is gone", plan.cached_source)
        return _Result(first_token=int(token_ids[-1]) % 7, elapsed_s=0.01)

    async def release(self, request_id):
        self.released.append(request_id)

    async def abort(self, request_id):
        self.aborted.append(request_id)


class Decode:
    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.fail = fail
        self.aborted: list[str] = []
        self.first: dict[str, int] = {}

    def receiver_ids(self, instance):
        return (0, 1)

    async def reserve(self, instance, request_id, prompt, sampling, generated=()):
        return None

    async def commit(self, instance, request_id, first_token):
        self.first[request_id] = first_token

    async def stream(self, instance, request_id):
        if request_id in self.fail:
            raise RuntimeError("decode rank lost")
        for step in range(2):
            yield OutputDelta(request_id, (self.first[request_id] + step,), "", step + 1,
                              step == 1, "length" if step == 1 else None)

    async def abort(self, instance, request_id):
        self.aborted.append(request_id)

    async def stats(self):
        return [None]


def _dispatcher(prefill, decode, enabled=True) -> Dispatcher:
    dep = load_deployment(None)
    dep = msgspec.structs.replace(dep, prefix_cache=PrefixCacheConfig(
        enabled=enabled, block_tokens=16, capacity_blocks=256))
    return Dispatcher(dep, prefill, decode, node_of=[0, 0, 1, 1], decode_capacities=[1 << 20],
                      metrics=ServingMetrics("tiny", requests=False))


def _req(rid, tokens) -> GenerateRequest:
    return GenerateRequest(rid, tuple(tokens), SamplingParams(max_tokens=2))


async def _run(d, req):
    return [o async for o in d.generate(req)]


DOC = list(range(1, 601))          # 37 whole blocks of 16
Q1 = DOC + [700, 701, 702]
Q2 = DOC[:512] + list(range(900, 980))


def test_second_question_plans_from_the_first_and_the_cache_keeps_its_kv():
    prefill, decode = Prefill(), Decode()
    d = _dispatcher(prefill, decode)

    async def scenario():
        outs = [await _run(d, _req("q1", Q1)), await _run(d, _req("q2", Q2))]
        return outs, await d.prefix_cache(), await d.prefix_cache(clear=True)

    (o1, o2), before, after = asyncio.run(scenario())
    # The hit is told once, on the client's first output.
    assert [o.cached_tokens for o in o1] == [0, 0]
    assert [o.cached_tokens for o in o2] == [512, 0]
    first, second = prefill.plans["q1"], prefill.plans["q2"]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 512 and second.cached_source == "q1"
    assert second.cached_instances == first.instances
    assert second.chunks[0].start == 512
    # Neither run's prefill KV was freed at hand-off: the cache held both until cleared.
    assert prefill.aborted == [] and sorted(prefill.released) == ["q1", "q2"]
    assert before["enabled"] and before["hits"] == 1 and before["queries"] == 2
    assert before["sources"] == 2 and after["blocks"] == 0 and after["sources"] == 0
    text = d.metrics.render().decode()
    assert 'tetris:prefix_cache_hits_total{model_name="tiny"} 1.0' in text
    assert 'tetris:prefix_cache_queries_total{model_name="tiny"} 2.0' in text
    assert 'tetris:prefix_cache_cached_tokens_total{model_name="tiny"} 512.0' in text
    assert d.held()["prefix_refs"] == 0 and d.held()["inflight"] == 0


def test_an_aborted_run_keeps_its_cached_prefill_and_a_failed_prefill_is_not_cached():
    prefill, decode = Prefill(), Decode(fail={"q1"})
    d = _dispatcher(prefill, decode)

    async def scenario():
        with pytest.raises(RuntimeError):
            await _run(d, _req("q1", Q1))
        await _run(d, _req("q2", Q2))
        return await d.prefix_cache(clear=True)

    after = asyncio.run(scenario())
    # q1's decode failed after its prefill: its KV stayed cached (not aborted) and served q2.
    assert decode.aborted == ["q1"] and prefill.aborted == []
    assert prefill.plans["q2"].cached_source == "q1"
    assert sorted(prefill.released) == ["q1", "q2"] and after["sources"] == 0


def test_disabled_cache_plans_and_frees_as_before():
    prefill, decode = Prefill(), Decode()
    d = _dispatcher(prefill, decode, enabled=False)

    async def scenario():
        await _run(d, _req("q1", Q1))
        await _run(d, _req("q2", Q2))
        return await d.prefix_cache()

    assert asyncio.run(scenario()) == {"enabled": False}
    assert prefill.plans["q2"].cached_tokens == 0
    assert prefill.released == ["q1", "q2"]
    assert "prefix_refs" not in d.held()


def test_a_prefix_gone_from_the_pool_is_forgotten_and_the_request_planned_again():
    prefill, decode = Prefill(lost_sources={"q1"}), Decode()
    d = _dispatcher(prefill, decode)

    async def scenario():
        await _run(d, _req("q1", Q1))
        outs = await _run(d, _req("q2", Q2))
        return outs, await d.prefix_cache()

    outs, cache = asyncio.run(scenario())
    # q2's first run read q1's prefix and found it gone; its run again computed it whole.
    assert prefill.plans["q2"].cached_tokens == 512 and prefill.aborted == ["q2"]
    again = [p for rid, p in prefill.plans.items() if rid.startswith("q2") and rid != "q2"]
    assert len(again) == 1 and again[0].cached_tokens == 0
    assert outs[-1].finished and [o.cached_tokens for o in outs] == [0, 0]
    assert "q1" in prefill.released   # forgotten, and released once nothing read it
    assert cache["hits"] == 1 and d.held()["prefix_refs"] == 0


def test_a_run_failing_in_prefill_is_forgotten_and_its_partial_kv_aborted():
    class FailingPrefill(Prefill):
        async def run(self, plan, token_ids, sampling, kv_receivers):
            if plan.request_id == "q2":
                raise RuntimeError("prefill failed")
            return await super().run(plan, token_ids, sampling, kv_receivers)

    prefill, decode = FailingPrefill(), Decode()
    d = _dispatcher(prefill, decode)

    async def scenario():
        await _run(d, _req("q1", Q1))
        with pytest.raises(RuntimeError):
            await _run(d, _req("q2", Q2))    # read q1's prefix, announced its own blocks
        return await d.prefix_cache()

    cache = asyncio.run(scenario())
    assert prefill.aborted == ["q2"]          # not the cache's: its partial KV is freed
    assert cache["sources"] == 1 and d.held()["prefix_refs"] == 0
    index = d.control.prefix_index
    index.check()
    assert index.match(index.hashes(Q2)).source == "q1"   # q2's blocks are gone
