"""The dispatcher's elastic decode wiring (``[decode] elastic``) against in-process fakes of
the two pools (no Ray): a request that fits no decode instance but their sum is placed over a
group (``elastic_place`` with the placer's ranges), its prefill streams ``kv_ranges`` to the
holders, the master starts through ``elastic_commit``, and every member's ranges and the
placer's usage are freed when it ends or is aborted. Without the config the same request is
refused; a request that fits one instance goes the whole-request way either way."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from test_dispatcher import FakeDecode, FakePrefill, _collect, _req
from test_dispatcher_retry import ToyDecode, ToyPrefill, _client_view, _reference, _text
from test_dispatcher_retry import _collect as _collect_toy

from tetris.config import load_deployment
from tetris.serve.backend import Overloaded
from tetris.serve.dispatcher import Dispatcher
from tetris.serve.metrics import ServingMetrics

CAPACITY = 512   # KV tokens per decode instance


class RangePrefill(FakePrefill):
    def __init__(self) -> None:
        super().__init__(receivers=((), (0, 1), (2, 3)))
        self.kv_ranges: dict[str, tuple] = {}

    async def run(self, plan, token_ids, sampling, kv_receivers, kv_ranges=()):
        self.kv_ranges[plan.request_id] = tuple(kv_ranges)
        assert bool(kv_ranges) != bool(kv_receivers)   # one or the other, as the pool checks
        return await super().run(plan, token_ids, sampling, kv_receivers)


class GroupDecode(FakeDecode):
    """Refuses a reservation beyond ``CAPACITY`` tokens on one instance, as DecodeFull does."""

    def __init__(self) -> None:
        super().__init__()
        self.placed: dict[str, list] = {}
        self.released: dict[str, list] = {}
        self.elastic_first: dict[str, int] = {}
        self.keep: dict[str, bool] = {}

    async def reserve(self, instance, request_id, prompt, sampling, generated=(),
                      keep=False) -> None:
        self.keep[request_id] = keep
        if len(prompt) + sampling.max_tokens > CAPACITY:
            raise Overloaded(f"decode instance {instance} has no KV room", retry_after_s=1.0)
        await super().reserve(instance, request_id, prompt, sampling, generated)

    async def elastic_place(self, request_id, prompt, sampling, ranges) -> None:
        for i, s, e in ranges:
            grow = sampling.max_tokens if (i, s, e) == tuple(ranges[-1]) else 0
            assert e - s + grow <= CAPACITY, ranges
        self.placed[request_id] = list(ranges)
        self.reserved[request_id] = (len(prompt), sampling.max_tokens)

    async def elastic_commit(self, request_id, ranges, first_token) -> None:
        assert list(ranges) == self.placed[request_id]
        self.elastic_first[request_id] = first_token
        self.first[request_id] = first_token

    async def elastic_release(self, request_id, ranges) -> None:
        self.released[request_id] = list(ranges)


def _dispatcher(prefill, decode, elastic: bool, prefix_cache: bool = False) -> Dispatcher:
    dep = load_deployment(None)
    dep = msgspec.structs.replace(dep, decode=msgspec.structs.replace(
        dep.decode, num_instances=2, elastic=elastic))
    if prefix_cache:
        dep = msgspec.structs.replace(dep, prefix_cache=msgspec.structs.replace(
            dep.prefix_cache, enabled=True, decode_runs=4))
    return Dispatcher(dep, prefill, decode, node_of=[0, 0, 1, 1],
                      decode_capacities=[CAPACITY, CAPACITY],
                      metrics=ServingMetrics("tiny", requests=False))


def _idle(d: Dispatcher) -> None:
    assert d.held() == {"inflight": 0, "queue_bookings": 0, "virtual_usage": 0,
                        "virtual_requests": 0, "cleanups": 0, "relayed": 0}
    assert not any(d.control.router.virtual) and not d.elastic.groups
    assert not d.elastic.placer.groups


def test_without_elastic_a_prompt_bigger_than_any_instance_is_refused():
    d = _dispatcher(RangePrefill(), GroupDecode(), elastic=False)
    with pytest.raises(Overloaded, match="no KV room"):
        asyncio.run(_collect(d, _req("a", 700, 4)))
    assert d.elastic is None


def test_a_prompt_bigger_than_any_instance_is_placed_over_both():
    prefill, decode = RangePrefill(), GroupDecode()
    d = _dispatcher(prefill, decode, elastic=True)
    outs = asyncio.run(_collect(d, _req("a", 700, 4)))
    assert [o.new_token_ids[0] for o in outs] == [700 % 7 + i for i in range(4)]
    (holder, s0, e0), (master, s1, e1) = decode.placed["a"]
    assert {holder, master} == {0, 1} and (s0, e0, s1, e1) == (0, s1, e0, 700)
    assert 700 - CAPACITY <= s1 <= CAPACITY   # each range fits its instance
    # the prefill streams each range to its instance's TP ranks: held ones as <id>@<start>
    ranges = prefill.kv_ranges["a"]
    assert [(r.start, r.end, r.transfer_id, r.receivers) for r in ranges] == [
        (0, s1, "a@0", decode.receiver_ids(holder)), (s1, 700, "a", decode.receiver_ids(master))]
    assert decode.elastic_first == {"a": 700 % 7}
    assert decode.released == {"a": decode.placed["a"]} and decode.aborted == []
    assert prefill.released == ["a"] and d.timelines[-1].decode_instance == master
    _idle(d)


def test_a_prompt_that_fits_one_instance_goes_whole():
    prefill, decode = RangePrefill(), GroupDecode()
    d = _dispatcher(prefill, decode, elastic=True)
    asyncio.run(_collect(d, _req("b", 300, 4)))
    assert prefill.kv_ranges["b"] == () and decode.placed == {} and decode.released == {}
    assert decode.first == {"b": 300 % 7}
    _idle(d)


def test_closing_a_split_stream_early_aborts_the_master_and_releases_every_range():
    prefill, decode = RangePrefill(), GroupDecode()
    d = _dispatcher(prefill, decode, elastic=True)

    async def main():
        gen = d.generate(_req("c", 700, 50))
        await anext(gen)
        await gen.aclose()

    asyncio.run(main())
    master = decode.placed["c"][-1][0]
    assert decode.released == {"c": decode.placed["c"]}
    assert "c" in decode.aborted and prefill.aborted == ["c"]
    assert d.timelines[-1].outcome == "aborted" and d.timelines[-1].decode_instance == master
    _idle(d)


def test_a_prompt_beyond_the_instances_sum_is_refused_and_frees_its_booking():
    d = _dispatcher(RangePrefill(), GroupDecode(), elastic=True)
    with pytest.raises(Overloaded, match="no KV room"):
        asyncio.run(_collect(d, _req("d", 2 * CAPACITY + 1, 4)))
    _idle(d)


def test_a_split_run_is_not_kept_for_prefix_reuse_a_whole_one_is():
    prefill, decode = RangePrefill(), GroupDecode()
    d = _dispatcher(prefill, decode, elastic=True, prefix_cache=True)
    asyncio.run(_collect(d, _req("e", 700, 4)))
    asyncio.run(_collect(d, _req("f", 300, 4)))
    assert "e" in decode.placed and "f" not in decode.placed
    kept = {run for runs in d.decode_kept._runs.values() for run in runs}
    assert kept == {"f"}   # the master of e holds only its range: nothing to copy a prefix from
    assert decode.keep == {"f": True}


class ToyGroupDecode(ToyDecode):
    """``ToyDecode`` (the retry tests' toy model) with the elastic calls: a group's run decodes
    at its master; ``placed`` and ``released`` record the groups."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.placed: list[tuple[str, list, tuple[int, ...]]] = []
        self.released: list[tuple[str, list]] = []

    async def reserve(self, instance, request_id, prompt, sampling, generated=(),
                      keep=False) -> None:
        if len(prompt) + sampling.max_tokens > CAPACITY:
            raise Overloaded(f"decode instance {instance} has no KV room", retry_after_s=1.0)
        await super().reserve(instance, request_id, prompt, sampling, generated)

    async def elastic_place(self, request_id, prompt, sampling, ranges, generated=()) -> None:
        self.placed.append((request_id, list(ranges), tuple(generated)))
        await super().reserve(ranges[-1][0], request_id, prompt, sampling, generated)

    async def elastic_commit(self, request_id, ranges, first_token) -> None:
        await self.commit(ranges[-1][0], request_id, first_token)

    async def elastic_release(self, request_id, ranges) -> None:
        self.released.append((request_id, list(ranges)))


class ToyRangePrefill(ToyPrefill):
    async def run(self, plan, token_ids, sampling, kv_receivers, kv_ranges=()):
        assert kv_ranges and not kv_receivers and kv_ranges[-1].end == len(token_ids)
        return await super().run(plan, token_ids, sampling, kv_receivers)


def test_a_lost_holder_resumes_the_request_over_a_new_group_with_each_token_once():
    """Four instances of 512 tokens: a 700-token request is split over 0 and 1; its holder
    dies after 4 tokens (the master's stream ends with an InstanceLost, HolderLost in the
    pool), the supervisor marks it down, and the run again is placed over 2 and 3 (its master
    0 is avoided as any lost run's instance is) with the 4 tokens the client has."""
    prompt = [(i * 7) % 50 + 3 for i in range(700)]
    d = None

    def holder_down(master):
        holder = d.elastic.ranges("a")[0][0]
        d.control.set_decode_up(holder, False)

    prefill, decode = ToyRangePrefill(), ToyGroupDecode(instances=4, lose_after={0: 4},
                                                        on_lose=holder_down)
    dep = load_deployment(None)
    dep = msgspec.structs.replace(dep, decode=msgspec.structs.replace(
        dep.decode, num_instances=4, elastic=True))
    d = Dispatcher(dep, prefill, decode, node_of=[0, 0, 1, 1],
                   decode_capacities=[CAPACITY] * 4,
                   metrics=ServingMetrics("tiny", requests=False))
    outs = asyncio.run(_collect_toy(d, "a", prompt, 12))
    ref = _reference(prompt, 12)
    assert _client_view(outs) == (ref, _text(ref))
    (_, first, gen0), (_, again, gen1) = decode.placed
    assert [i for i, _, _ in first] == [1, 0] and gen0 == ()
    # the run again: prompt and the 4 tokens tiled over instances 2 and 3, no others
    assert sorted(i for i, _, _ in again) == [2, 3] and gen1 == tuple(ref[:4])
    assert again[0][1] == 0 and again[0][2] == again[1][1] and again[1][2] == 704
    assert prefill.ran == [("a", 700), ("a#retry1", 704)]
    # both groups released on every member: the lost one at the loss, the second at the end
    assert decode.released == [("a", first), ("a#retry1", again)]
    assert "a" in decode.aborted and d.timelines[-1].retries == 1
    _idle(d)
