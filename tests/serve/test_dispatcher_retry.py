"""Requests that lose their prefill worker or decode instance run again and resume where the
client's stream stopped (``Dispatcher.generate``), against in-process fakes (no Ray).

The fakes share one toy model, ``_next``: the next token is a function of every token before
it. A run that resumes from the wrong place, repeats a token or drops one gives a different
stream from the run that lost nothing.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tetris.config import load_deployment
from tetris.engine.request import OutputDelta, Transcript
from tetris.errors import InstanceLost, InstanceReplacing, PlanOutdated
from tetris.sampling_params import SamplingParams
from tetris.serve.dispatcher import Dispatcher
from tetris.serve.first_token import EarlyFirstToken
from tetris.serve.metrics import ServingMetrics
from tetris.serve.protocol import GenerateRequest
from tetris.serve.relay import follow

_IDLE = {"inflight": 0, "queue_bookings": 0, "virtual_usage": 0, "virtual_requests": 0,
         "cleanups": 0, "relayed": 0}


def _next(tokens) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 26


def _text(tokens) -> str:
    return "".join(chr(ord("a") + t) for t in tokens)


class _Result(msgspec.Struct):
    first_token: int
    elapsed_s: float
    turn_wait_s: float = 0.0


class ToyPrefill:
    """Samples ``_next`` of the prompt it is given; ``lose`` runs raise ``InstanceLost``
    (``PlanOutdated`` with ``outdated``). Instances in ``lost`` are being replaced: a plan on
    one is refused at commit, as ``PrefillPool.commit`` does, unless told to wait."""

    def __init__(self, lose: int = 0, outdated: bool = False) -> None:
        self.lose = lose
        self.outdated = outdated
        self.ran: list[tuple[str, int]] = []     # (run id, prompt tokens)
        self.plans: list = []
        self.refused: list = []                  # plans refused at commit
        self.waited: list = []                   # plans committed with wait_replacing
        self.aborted: list[str] = []
        self.released: list[str] = []
        self.reports = 0                         # busy_for asked (a run again)
        self.lost: set[int] = set()              # instances being replaced

    async def commit(self, plan, wait_replacing: bool = False) -> None:
        on = {i for c in plan.chunks for i in c.instances} & self.lost
        if on and not wait_replacing:
            self.refused.append(plan)
            raise InstanceReplacing(f"plan {plan.request_id} uses instances {sorted(on)}")
        if wait_replacing:
            self.waited.append(plan)

    async def busy_for(self):
        self.reports += 1
        return [float("inf") if i in self.lost else 0.0 for i in range(4)]

    async def run(self, plan, token_ids, sampling, kv_receivers):
        self.ran.append((plan.request_id, len(token_ids)))
        self.plans.append(plan)
        await asyncio.sleep(0)
        if self.lose:
            self.lose -= 1
            self.lost |= set(plan.chunks[0].instances)
            raise (PlanOutdated if self.outdated else InstanceLost)("prefill worker 1 died")
        return _Result(_next(list(token_ids)), 0.001)

    async def release(self, request_id: str) -> None:
        self.released.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class ToyDecode:
    """Decodes ``_next`` over prompt + outputs, as an engine that resumes from ``generated``
    would: the first output of a run carries every output token and the whole text again.
    ``lose_after[i]``: instance ``i`` dies after streaming that many outputs (once)."""

    def __init__(self, instances: int = 1, lose_after: dict[int, int] | None = None,
                 on_lose=None) -> None:
        self.instances = instances
        self.lose_after = dict(lose_after or {})
        self.on_lose = on_lose   # called with the instance as it dies
        self.runs: dict[str, dict] = {}
        self.reserved_on: list[tuple[str, int, tuple[int, ...]]] = []
        self.aborted: list[str] = []

    def receiver_ids(self, instance: int) -> tuple[int, ...]:
        return (instance,)

    async def reserve(self, instance, request_id, prompt, sampling, generated=()) -> None:
        self.reserved_on.append((request_id, instance, tuple(generated)))
        self.runs[request_id] = {"prompt": list(prompt), "out": list(generated),
                                 "max": sampling.max_tokens}

    async def commit(self, instance, request_id, first_token) -> None:
        self.runs[request_id]["out"].append(first_token)

    async def stream(self, instance, request_id):
        run = self.runs[request_id]
        out, sent_chars, streamed = run["out"], 0, 0
        while True:
            done = len(out) >= run["max"]
            text = _text(out)
            # as a decode instance streams a resumed run: the new token only, its count
            # including the tokens taken as already made, and the text from its beginning
            yield OutputDelta(request_id, (out[-1],), text[sent_chars:], len(out), done,
                              "length" if done else None)
            sent_chars, streamed = len(text), streamed + 1
            if done:
                self.runs.pop(request_id)
                return
            if self.lose_after.get(instance) == streamed:
                del self.lose_after[instance]
                if self.on_lose is not None:
                    self.on_lose(instance)
                raise InstanceLost(f"decode instance {instance} failed: rank 1 died")
            await asyncio.sleep(0)
            out.append(_next(run["prompt"] + out))

    async def abort(self, instance, request_id) -> None:
        self.aborted.append(request_id)
        self.runs.pop(request_id, None)

    async def stats(self):
        return [None] * self.instances


def _dispatcher(prefill, decode, instances: int = 1, **kw) -> Dispatcher:
    return Dispatcher(load_deployment(None), prefill, decode, node_of=[0, 0, 1, 1],
                      decode_capacities=[1 << 20] * instances,
                      metrics=ServingMetrics("tiny", requests=False), **kw)


def _reference(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(_next(prompt + out))
    return out


async def _collect(d: Dispatcher, rid: str, prompt: list[int], n: int) -> list[OutputDelta]:
    """The client's stream; a relaying dispatcher's decode outputs are streamed from the decode
    pool by the caller, as the ingress does (``tetris.serve.relay.follow``)."""
    req = GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=n))
    if not d.relay:
        return [o async for o in d.generate(req)]

    async def report(run_id, rep):
        d.relay_report(run_id, rep)

    return [o async for o in follow(d.generate(req), d.decode.stream, report)]


def _client_view(outs: list[OutputDelta]) -> tuple[list[int], str]:
    """What a streaming client assembles from the deltas (whose counts must follow on)."""
    whole = Transcript()
    for o in outs:
        whole.add(o)
    return whole.token_ids, whole.text


def _retries(d: Dispatcher) -> dict[str, float]:
    return {ln.split('stage="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
            for ln in d.metrics.render().decode().splitlines()
            if ln.startswith("tetris:request_retries_total{")}


PROMPT = list(range(3, 40))


@pytest.mark.parametrize("relay", [False, True], ids=["dispatcher-streams", "relayed"])
@pytest.mark.parametrize("early", [False, True])
def test_a_decode_instance_lost_mid_stream_resumes_on_another_with_each_token_once(early, relay):
    prefill, decode = ToyPrefill(), ToyDecode(instances=2, lose_after={0: 4})
    first = EarlyFirstToken(_text, (), 1 << 20) if early else None
    d = _dispatcher(prefill, decode, instances=2, first_token=first, relay=relay)
    outs = asyncio.run(_collect(d, "a", PROMPT, 12))
    ref = _reference(PROMPT, 12)
    assert _client_view(outs) == (ref, _text(ref))
    assert outs[-1].num_tokens == len(ref)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert {o.request_id for o in outs} == {"a"}
    # the run again went to the other instance and was told the four tokens the client had
    assert decode.reserved_on == [("a", 0, ()), ("a#retry1", 1, tuple(ref[:4]))]
    assert prefill.ran == [("a", len(PROMPT)), ("a#retry1", len(PROMPT) + 4)]
    # the lost run was freed on both sides; the second completed and released its prefill KV
    assert decode.aborted == ["a"] and prefill.aborted == ["a"]
    assert prefill.released == ["a", "a#retry1"]
    tl = d.timelines[-1]
    assert tl.retries == 1 and tl.outcome == "length" and tl.decode_instance == 1
    assert d.held() == _IDLE and _retries(d) == {"decode": 1.0}


def test_a_lost_prefill_worker_replans_the_request_before_any_token():
    prefill, decode = ToyPrefill(lose=1), ToyDecode()
    d = _dispatcher(prefill, decode)
    outs = asyncio.run(_collect(d, "p", PROMPT, 5))
    ref = _reference(PROMPT, 5)
    assert _client_view(outs) == (ref, _text(ref))
    assert prefill.ran == [("p", len(PROMPT)), ("p#retry1", len(PROMPT))]
    # the run again asked the pool first, and is planned around the instance being replaced
    assert prefill.reports == 1
    lost = set(prefill.plans[0].chunks[0].instances)
    assert not lost & {i for c in prefill.plans[1].chunks for i in c.instances}
    # a lost prefill keeps its (healthy) decode instance in routing
    assert [r[1:] for r in decode.reserved_on] == [(0, ()), (0, ())]
    assert "p" in decode.aborted and "p" in prefill.aborted
    assert d.held() == _IDLE and _retries(d) == {"prefill": 1.0}


def test_with_one_decode_instance_the_run_again_waits_until_it_is_back():
    prefill = ToyPrefill()
    d = None

    def broke(instance):
        # as the Serve healer does: out of routing at once, back once restarted
        d.set_decode_up(instance, False)
        asyncio.get_running_loop().call_later(0.2, d.set_decode_up, instance, True)

    decode = ToyDecode(lose_after={0: 2}, on_lose=broke)
    d = _dispatcher(prefill, decode, retry_poll_s=0.01)
    outs = asyncio.run(_collect(d, "w", PROMPT, 6))
    ref = _reference(PROMPT, 6)
    assert _client_view(outs) == (ref, _text(ref))
    assert decode.reserved_on == [("w", 0, ()), ("w#retry1", 0, tuple(ref[:2]))]
    (tl,) = d.timelines
    assert tl.finished - tl.arrival >= 0.2       # it waited for the instance
    assert d.held() == _IDLE and d.stats()["decode_down"] == []


def test_no_instance_back_within_the_wait_fails_the_request_and_frees_it():
    prefill = ToyPrefill()
    d = None
    decode = ToyDecode(lose_after={0: 1}, on_lose=lambda i: d.set_decode_up(i, False))
    d = _dispatcher(prefill, decode, retry_wait_s=0.05, retry_poll_s=0.01)
    outs = []

    async def main():
        async for o in d.generate(GenerateRequest("x", tuple(PROMPT), SamplingParams(max_tokens=5))):
            outs.append(o)

    with pytest.raises(RuntimeError, match="no decode instance took it back within 0.05 s"):
        asyncio.run(main())
    assert len(outs) == 1 and d.timelines[-1].outcome == "error"
    assert [r[0] for r in decode.reserved_on] == ["x"]
    assert d.held() == _IDLE


def test_retries_are_bounded_and_the_last_loss_reaches_the_caller():
    prefill, decode = ToyPrefill(lose=3), ToyDecode()
    d = _dispatcher(prefill, decode, retries=2)
    with pytest.raises(InstanceLost, match="prefill worker 1 died"):
        asyncio.run(_collect(d, "b", PROMPT, 4))
    assert [r[0] for r in prefill.ran] == ["b", "b#retry1", "b#retry2"]
    assert sorted(prefill.aborted) == ["b", "b#retry1", "b#retry2"]
    assert d.timelines[-1].retries == 2 and d.timelines[-1].outcome == "error"
    assert d.held() == _IDLE

    none = _dispatcher(ToyPrefill(lose=1), ToyDecode(), retries=0)
    with pytest.raises(InstanceLost):
        asyncio.run(_collect(none, "c", PROMPT, 4))
    with pytest.raises(ValueError, match="retries"):
        _dispatcher(ToyPrefill(), ToyDecode(), retries=-1)


@pytest.mark.parametrize("relay", [False, True], ids=["dispatcher-streams", "relayed"])
def test_a_client_that_leaves_during_the_run_again_frees_both_runs(relay):
    prefill, decode = ToyPrefill(), ToyDecode(instances=2, lose_after={0: 3})
    d = _dispatcher(prefill, decode, instances=2, relay=relay)

    async def report(run_id, rep):
        d.relay_report(run_id, rep)

    async def main():
        gen = d.generate(GenerateRequest("z", tuple(PROMPT), SamplingParams(max_tokens=50)))
        if relay:
            gen = follow(gen, decode.stream, report)
        outs = [await anext(gen) for _ in range(5)]   # 3 from the first run, 2 from the second
        await gen.aclose()
        return outs

    outs = asyncio.run(main())
    ref = _reference(PROMPT, 5)
    assert _client_view(outs)[0] == ref
    assert sorted(decode.aborted) == ["z", "z#retry1"] and decode.runs == {}
    assert d.timelines[-1].outcome == "aborted" and d.held() == _IDLE


def test_a_plan_refused_for_an_instance_being_replaced_is_made_again_around_it():
    """The first plan after a worker was found dead is made before the dispatcher hears of
    it; the pool refuses it at commit and the dispatcher plans again on a fresh report, before
    anything ran: no run again, nothing charged against the retries."""
    prefill, decode = ToyPrefill(), ToyDecode()
    d = _dispatcher(prefill, decode)
    asyncio.run(_collect(d, "warm", PROMPT, 2))       # bookings and reports: all idle
    # the instances the next plan would take are found dead since the last report
    probe = d.control.plan("probe", len(PROMPT), d.clock(), arrival=False)
    first = {i for c in probe.chunks for i in c.instances}
    prefill.lost = set(first)
    outs = asyncio.run(_collect(d, "r", PROMPT, 4))
    assert _client_view(outs) == (_reference(PROMPT, 4), _text(_reference(PROMPT, 4)))
    assert [p.request_id for p in prefill.refused] == ["r"] and prefill.reports == 1
    (plan,) = [p for p in prefill.plans if p.request_id == "r"]
    assert not first & {i for c in plan.chunks for i in c.instances}
    assert prefill.waited == [] and [r for r, _ in prefill.ran] == ["warm", "r"]
    tl = d.timelines[-1]
    assert tl.retries == 0 and tl.outcome == "length" and d.held() == _IDLE
    assert _retries(d) == {}


def test_when_every_instance_is_being_replaced_the_last_plan_waits_for_one():
    prefill, decode = ToyPrefill(), ToyDecode()
    prefill.lost = {0, 1, 2, 3}
    d = _dispatcher(prefill, decode)
    outs = asyncio.run(_collect(d, "all", PROMPT, 3))
    assert _client_view(outs)[0] == _reference(PROMPT, 3)
    # refused twice, then committed to wait for the replacement (nothing better exists)
    assert len(prefill.refused) == 2 and [p.request_id for p in prefill.waited] == ["all"]
    assert prefill.reports == 2 and d.held() == _IDLE


def test_runs_lost_to_outdated_plans_are_not_charged_against_the_retries():
    """A run lost because its plan predates a worker's death lost no work there: with
    ``retries=1`` it still runs again three times (each needs a new death in practice)."""
    prefill, decode = ToyPrefill(lose=3, outdated=True), ToyDecode()
    d = _dispatcher(prefill, decode, retries=1)
    outs = asyncio.run(_collect(d, "o", PROMPT, 3))
    assert _client_view(outs)[0] == _reference(PROMPT, 3)
    assert [r for r, _ in prefill.ran] == ["o", "o#retry1", "o#retry2", "o#retry3"]
    assert d.timelines[-1].retries == 3 and d.held() == _IDLE
    # bounded all the same: past the outdated allowance a loss is charged as any other
    endless, decode = ToyPrefill(lose=100, outdated=True), ToyDecode()
    e = _dispatcher(endless, decode, retries=1)
    with pytest.raises(PlanOutdated):
        asyncio.run(_collect(e, "e", PROMPT, 3))
    assert len(endless.ran) == 1 + 4 + 1 and e.held() == _IDLE


def test_relayed_the_dispatcher_sees_two_events_per_run_not_each_token():
    """The ingress streams the decode outputs; the dispatcher yields the early first token
    and one hand-off per run, and hears of the KV's arrival and of the stream's end."""
    prefill, decode = ToyPrefill(), ToyDecode(instances=2, lose_after={0: 4})
    d = _dispatcher(prefill, decode, instances=2, relay=True,
                    first_token=EarlyFirstToken(_text, (), 1 << 20))
    from_dispatcher, reports = [], []

    async def report(run_id, rep):
        reports.append((run_id, rep.kind, len(rep.token_ids)))
        d.relay_report(run_id, rep)

    async def dispatched(req):
        async for item in d.generate(req):
            from_dispatcher.append(type(item).__name__)
            yield item

    async def main():
        req = GenerateRequest("r", tuple(PROMPT), SamplingParams(max_tokens=12))
        return [o async for o in follow(dispatched(req), decode.stream, report)]

    outs = asyncio.run(main())
    ref = _reference(PROMPT, 12)
    assert _client_view(outs) == (ref, _text(ref))
    assert from_dispatcher == ["OutputDelta", "DecodeHandoff", "DecodeHandoff"]
    # run 1 gave the client tokens 2-4 (the first came early) before its instance was lost
    assert reports == [("r", "kv_arrived", 0), ("r", "lost", 3),
                       ("r#retry1", "kv_arrived", 0), ("r#retry1", "finished", 8)]
    assert prefill.released == ["r", "r#retry1"] and d.held() == _IDLE


def test_relayed_a_decode_stream_that_fails_otherwise_fails_the_request_and_frees_it():
    class Broken(ToyDecode):
        async def stream(self, instance, request_id):
            yield OutputDelta(request_id, (1,), "b", 1, False, None)
            raise KeyError("rank state")

    prefill, decode = ToyPrefill(), Broken()
    d = _dispatcher(prefill, decode, relay=True)
    with pytest.raises(RuntimeError, match="KeyError"):
        asyncio.run(_collect(d, "f", PROMPT, 5))
    assert d.timelines[-1].outcome == "error" and d.held() == _IDLE
    assert "f" in decode.aborted and "f" in prefill.aborted


def test_relayed_an_end_report_that_overtakes_the_arrival_report_still_frees_the_prefill_kv():
    """The ingress sends the arrival report without waiting for it; the end report may reach
    the dispatcher first. The prefill side must still free its copy of the KV."""
    prefill, decode = ToyPrefill(), ToyDecode()
    d = _dispatcher(prefill, decode, relay=True)
    held_back = []

    async def report(run_id, rep):
        if rep.kind == "kv_arrived":
            held_back.append((run_id, rep))   # delivered after the end, or never
            return
        d.relay_report(run_id, rep)

    async def main():
        req = GenerateRequest("o", tuple(PROMPT), SamplingParams(max_tokens=3))
        outs = [o async for o in follow(d.generate(req), decode.stream, report)]
        for run_id, rep in held_back:
            assert not d.relay_report(run_id, rep)   # the run is over: dropped
        return outs

    outs = asyncio.run(main())
    assert _client_view(outs)[0] == _reference(PROMPT, 3)
    assert prefill.released == ["o"] and prefill.aborted == [] and d.held() == _IDLE
