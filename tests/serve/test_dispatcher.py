"""The dispatcher's control logic against in-process fakes of the two pools (no Ray)."""

from __future__ import annotations

import asyncio
import sys

import msgspec
import pytest

from tetris.config import load_deployment
from tetris.engine.request import OutputDelta
from tetris.plan import PrefillPlan
from tetris.sampling_params import SamplingParams
from tetris.scheduler.rate import RateTableError
from tetris.serve.backend import Overloaded
from tetris.serve.dispatcher import Dispatcher
from tetris.serve.metrics import ServingMetrics
from tetris.serve.protocol import GenerateRequest


class _Result(msgspec.Struct):
    first_token: int
    elapsed_s: float
    turn_wait_s: float = 0.0


class FakePrefill:
    def __init__(self, delay: float = 0.01, receivers=((0, 1),)) -> None:
        self.delay = delay
        self.receivers = receivers   # the decode instances' receiver ids it may be given
        self.committed: list[str] = []
        self.ran: list[str] = []
        self.released: list[str] = []
        self.aborted: list[str] = []

    async def commit(self, plan: PrefillPlan, wait_replacing: bool = False) -> None:
        self.committed.append(plan.request_id)

    async def busy_for(self) -> None:
        return None

    async def run(self, plan, token_ids, sampling, kv_receivers):
        assert kv_receivers in self.receivers
        self.ran.append(plan.request_id)
        await asyncio.sleep(self.delay)
        return _Result(first_token=token_ids[-1] % 7, elapsed_s=self.delay)

    async def release(self, request_id: str) -> None:
        self.released.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class FakeDecode:
    """Echoes ``first_token, first_token + 1, ...`` for ``max_tokens`` steps."""

    def __init__(self, *, full: bool = False, fail_after: int | None = None) -> None:
        self.full = full
        self.fail_after = fail_after
        self.reserved: dict[str, tuple[int, int]] = {}
        self.first: dict[str, int] = {}
        self.aborted: list[str] = []

    def receiver_ids(self, instance: int) -> tuple[int, ...]:
        return (2 * instance, 2 * instance + 1)

    async def reserve(self, instance, request_id, prompt, sampling, generated=()) -> None:
        if self.full:
            raise Overloaded("no KV room", retry_after_s=2.0)
        self.reserved[request_id] = (len(prompt), sampling.max_tokens)

    async def commit(self, instance, request_id, first_token) -> None:
        self.first[request_id] = first_token

    async def stream(self, instance, request_id):
        prompt_len, n = self.reserved[request_id]
        tokens: list[int] = []
        for step in range(n):
            if self.fail_after is not None and step == self.fail_after:
                raise RuntimeError("decode rank lost")
            tokens.append(self.first[request_id] + step)
            await asyncio.sleep(0)
            yield OutputDelta(request_id, (tokens[-1],), "", len(tokens), step == n - 1,
                              "length" if step == n - 1 else None)
        self.reserved.pop(request_id)

    async def abort(self, instance, request_id) -> None:
        self.aborted.append(request_id)
        self.reserved.pop(request_id, None)

    async def stats(self):
        return [None]


def _dispatcher(prefill=None, decode=None, **kw) -> Dispatcher:
    dep = load_deployment(None)
    return Dispatcher(dep, prefill or FakePrefill(), decode or FakeDecode(),
                      node_of=[0, 0, 1, 1], decode_capacities=[4096],
                      metrics=ServingMetrics("tiny", requests=False), **kw)


def _req(rid: str, n: int = 600, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(rid, tuple(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


async def _collect(d: Dispatcher, req: GenerateRequest) -> list[OutputDelta]:
    return [out async for out in d.generate(req)]


def test_request_runs_to_the_end_and_frees_everything():
    prefill, decode = FakePrefill(), FakeDecode()
    d = _dispatcher(prefill, decode)
    outs = asyncio.run(_collect(d, _req("a", 600, 4)))
    assert [o.new_token_ids[0] for o in outs] == [600 % 7 + i for i in range(4)]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert prefill.committed == prefill.ran == prefill.released == ["a"]
    assert prefill.aborted == [] and decode.aborted == []
    assert d.held() == {"inflight": 0, "queue_bookings": 0, "virtual_usage": 0,
                        "virtual_requests": 0, "cleanups": 0, "relayed": 0}
    (tl,) = d.timelines
    b = tl.breakdown()
    assert tl.outcome == "length" and tl.chunks >= 1 and tl.tokens == 4
    assert min(b.values()) >= 0.0
    assert b["queue_s"] + b["prefill_s"] + b["handoff_s"] == pytest.approx(b["ttft_s"])
    text = d.metrics.render().decode()
    assert 'tetris:prefill_chunks_per_request_count{model_name="tiny"} 1.0' in text
    assert 'tetris:request_queue_time_seconds_count{model_name="tiny"} 1.0' in text


def test_closing_the_stream_early_aborts_both_sides():
    prefill, decode = FakePrefill(), FakeDecode()
    d = _dispatcher(prefill, decode)

    async def main():
        gen = d.generate(_req("b", 300, 50))
        first = await anext(gen)
        await gen.aclose()
        return first

    first = asyncio.run(main())
    assert not first.finished
    assert prefill.aborted == ["b"] and decode.aborted == ["b"]
    assert d.held()["inflight"] == 0 and d.held()["virtual_usage"] == 0
    assert d.timelines[-1].outcome == "aborted"


def test_decode_failure_propagates_and_cleans_up():
    prefill, decode = FakePrefill(), FakeDecode(fail_after=2)
    d = _dispatcher(prefill, decode)
    with pytest.raises(RuntimeError, match="decode rank lost"):
        asyncio.run(_collect(d, _req("c", 100, 8)))
    assert decode.aborted == ["c"] and prefill.aborted == ["c"]
    assert d.held()["queue_bookings"] == 0 and d.held()["virtual_usage"] == 0


def test_overload_is_refused_without_holding_anything():
    d = _dispatcher(decode=FakeDecode(full=True))
    with pytest.raises(Overloaded):
        asyncio.run(_collect(d, _req("d")))
    assert d.held() == {"inflight": 0, "queue_bookings": 0, "virtual_usage": 0,
                        "virtual_requests": 0, "cleanups": 0, "relayed": 0}

    bounded = _dispatcher(prefill=FakePrefill(delay=0.2), max_pending=1)

    async def two():
        first = asyncio.ensure_future(_collect(bounded, _req("e")))
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match="limit 1"):
            await _collect(bounded, _req("f"))
        return await first

    assert asyncio.run(two())[-1].finished


class _InstanceDecode(FakeDecode):
    """Records which decode instance each request was reserved on."""

    def __init__(self) -> None:
        super().__init__()
        self.instance_of: dict[str, int] = {}

    async def reserve(self, instance, request_id, prompt, sampling, generated=()) -> None:
        self.instance_of[request_id] = instance
        await super().reserve(instance, request_id, prompt, sampling)

    async def stats(self):
        return [None, None]


def test_a_decode_instance_marked_down_gets_no_requests_until_it_is_up():
    decode = _InstanceDecode()
    d = Dispatcher(load_deployment(None), FakePrefill(receivers=((0, 1), (2, 3))), decode,
                   node_of=[0, 0, 1, 1], decode_capacities=[4096, 4096],
                   metrics=ServingMetrics("tiny", requests=False))

    def up_gauge() -> list[str]:
        return [ln for ln in d.metrics.render().decode().splitlines()
                if ln.startswith("tetris:decode_instance_up{")]

    assert up_gauge() == ['tetris:decode_instance_up{instance="0",model_name="tiny"} 1.0',
                          'tetris:decode_instance_up{instance="1",model_name="tiny"} 1.0']
    d.set_decode_up(0, False)
    assert up_gauge()[0].endswith(" 0.0") and up_gauge()[1].endswith(" 1.0")
    for k in range(3):
        assert asyncio.run(_collect(d, _req(f"r{k}")))[-1].finished
    assert set(decode.instance_of.values()) == {1} and d.stats()["decode_down"] == [0]
    d.set_decode_up(1, False)
    with pytest.raises(Overloaded, match="all 2 decode instances are down") as e:
        asyncio.run(_collect(d, _req("none")))
    assert e.value.retry_after_s > 0 and "none" not in decode.instance_of
    assert d.held() == {"inflight": 0, "queue_bookings": 0, "virtual_usage": 0,
                        "virtual_requests": 0, "cleanups": 0, "relayed": 0}
    d.set_decode_up(0, True)
    assert asyncio.run(_collect(d, _req("back")))[-1].finished
    assert decode.instance_of["back"] == 0 and d.stats()["decode_down"] == [1]


def test_concurrent_requests_commit_in_planning_order_and_spread_over_the_pool():
    prefill = FakePrefill(delay=0.05)
    d = _dispatcher(prefill)

    async def many():
        return await asyncio.gather(*[_collect(d, _req(f"r{i}", 2000, 2)) for i in range(6)])

    results = asyncio.run(many())
    assert all(r[-1].finished for r in results)
    planned = [p["request_id"] for p in d.plans]
    assert prefill.committed == planned
    used = {i for p in d.plans for c in p["chunks"] for i in c["instances"]}
    assert used == {0, 1, 2, 3}     # later requests saw the earlier ones' bookings
    assert d.held()["queue_bookings"] == 0


def test_a_late_pool_keeps_plans_off_its_busy_instances():
    """The pool's report (not the bookings, which say free) steers the next plan."""

    class LatePrefill(FakePrefill):
        async def commit(self, plan, wait_replacing=False):
            await super().commit(plan)
            return [30.0, 30.0, 30.0, 0.0]   # 0-2 still have 30 s of queued work

    d = _dispatcher(LatePrefill())
    asyncio.run(_collect(d, _req("a", 600)))
    asyncio.run(_collect(d, _req("b", 600)))
    assert [tuple(c["instances"]) for c in d.plans[1]["chunks"]] == [(3,)]
    late = d.control.queue.queue_times(d.clock())
    assert min(late[:3]) > d.clock() + 20 and late[3] <= d.clock() + 1


def test_drained_instances_make_cdsp_grow_onto_them_later():
    d = _dispatcher()
    d.drain([0, 1], 0.2)
    plan = d.control.policy.plan("y", 32_000, d.clock(), d.control.queue.pool_state(d.clock()),
                         improvement_rate=0.0)
    assert set(plan.chunks[0].instances) == {2, 3}
    assert len(plan.chunks) >= 2 and set(plan.chunks[-1].instances) == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        d.drain([0], 0.0)


def test_admin_rate_table_and_profile_round_trip():
    d = _dispatcher()
    out = d.set_rate_table([0.5, 2.0], [0.1, 0.4], "test")
    assert out["rates"] == [0.5, 2.0] and out["improvement_rates"] == [0.1, 0.4]
    # the live monitor stretches a sparse window as the simulator's does
    assert d.control.monitor.min_arrivals == d.deployment.scheduler.rate_min_arrivals == 100
    with pytest.raises(RateTableError):
        d.set_rate_table([1.0], [1.5])
    assert d.rate_table()["rates"] == [0.5, 2.0]          # a bad table changed nothing
    prof = d.latency_profile()
    again = d.set_latency_profile(prof)
    assert again == prof
    with pytest.raises(ValueError):
        d.set_latency_profile({"name": "x", "coefficients": "nope"})


class _RecordingPrefill(FakePrefill):
    def __init__(self) -> None:
        super().__init__(delay=0.0)
        self.token_ids = None

    async def run(self, plan, token_ids, sampling, kv_receivers):
        self.token_ids = token_ids
        return await super().run(plan, token_ids, sampling, kv_receivers)


class _RecordingDecode(FakeDecode):
    """Records the prompt it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt = None

    async def reserve(self, instance, request_id, prompt, sampling, generated=()) -> None:
        self.prompt = prompt
        await super().reserve(instance, request_id, prompt, sampling)


def test_long_prompt_travels_as_one_int32_buffer_and_outputs_are_deltas():
    from array import array

    from tetris.serve.first_token import EarlyFirstToken

    n = 100_000
    prefill, decode = _RecordingPrefill(), _RecordingDecode()
    d = Dispatcher(load_deployment(None), prefill, decode, node_of=[0, 0, 1, 1],
                   decode_capacities=[2 * n], first_token=EarlyFirstToken(None, (), 4 * n))
    ids = [(7919 * i) % 128_256 for i in range(n)]     # Llama-3-sized vocabulary ids
    req = GenerateRequest("long", tuple(ids), SamplingParams(max_tokens=3))
    outs = asyncio.run(_collect(d, req))
    for sent in (prefill.token_ids, decode.prompt):
        assert isinstance(sent, array) and sent.typecode == "i" and sent.itemsize == 4
        assert sent is req.prompt_token_ids            # no copy inside the dispatcher
        assert sent.tolist() == ids
        assert sys.getsizeof(sent) < 4 * n + 1024      # ~4 bytes a token, not ~36
    assert sys.getsizeof(tuple(ids)) + sum(sys.getsizeof(t) for t in ids) > 30 * n
    # the first output is the dispatcher's early first token, the rest come from decode
    assert [o.new_token_ids[0] for o in outs] == [ids[-1] % 7 + i for i in range(3)]
    assert d.timelines[-1].first_token > 0
    assert all(type(o) is OutputDelta and o.request_id == "long" for o in outs)
    assert [o.num_tokens for o in outs] == [1, 2, 3]
