"""Elastic decode on the decode pool's Ray actors (actors/decode/elastic_pool.py): two TP-1
decode instances in one ``ElasticWorld``, their round loops stepping together through its
gate. Request a is placed over both (tokens [0, 15) held by instance 1, the rest mastered by
instance 0), each range's KV streamed by a real sender over NIXL; instance 1 also decodes a
request of its own, prefilled locally, in the same rounds. Both give the single engine's
tokens and logprobs, and after ``release`` nothing is held. Then instance 1's rank is killed
while a split request decodes: the request's stream ends with ``HolderLost`` (an
``InstanceLost``: the dispatcher's resume path), its tokens so far the engine's."""

from __future__ import annotations

import asyncio

import pytest
import ray
from exactness import assert_same_run
from test_decode_instance import (
    GREEDY_LP,
    MODEL,
    TRANSFER,
    Reference,
    TestSenderActor,
    _logprobs,
    _prompt,
    _tokens,
)
from tetris.actors.decode.elastic_pool import ElasticWorld
from tetris.actors.decode.instance import DecodeInstance
from tetris.actors.decode.messages import HolderLost
from tetris.transfer.backends import nixl_unavailable_reason

from tetris.config import DecodeConfig, DeploymentConfig
from tetris.errors import InstanceLost
from tetris.sampling_params import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

DEPLOYMENT = DeploymentConfig(model=MODEL, decode=DecodeConfig(
    tp_size=1, max_batch_size=4, block_size=4, kv_blocks=24))
RANGES = [(1, 0, 15), (0, 15, 33)]   # (instance, start, end); the last one masters


@pytest.fixture(scope="module")
def reference():
    return Reference()


@pytest.fixture(scope="module")
def world(ray_session, loop):
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    insts = [DecodeInstance(DEPLOYMENT, i, transfer=TRANSFER) for i in range(2)]
    for inst in insts:
        loop.run_until_complete(inst.start())
    senders = [TestSenderActor.remote(i, TRANSFER) for i in range(2)]   # sender i -> instance i
    for i, (inst, sender) in enumerate(zip(insts, senders, strict=True)):
        infos = loop.run_until_complete(inst.agent_infos())
        ray.get(sender.connect.remote(infos, {i: inst.ranks[0]}))
        loop.run_until_complete(inst.connect_senders({i: sender}))
    w = ElasticWorld(insts, timeout_s=60.0)
    loop.run_until_complete(w.start())
    yield insts, senders, w
    for inst in insts:
        loop.run_until_complete(inst.shutdown())
    for s in senders:
        ray.kill(s)


async def _place_and_stream(w, senders, reference, rid, prompt, params):
    """Place ``prompt`` over RANGES, stream each range's KV to its holder, commit."""
    await w.place(rid, prompt, params, RANGES)
    kv = reference.prompt_kv(prompt)
    for inst, s, e in RANGES:
        tid = rid if inst == RANGES[-1][0] else f"{rid}@{s}"
        await senders[inst].send.remote(tid, inst, e - s, 0, (0, e - s),
                                        [layer[s:e] for layer in kv], len(kv))
    tokens, entries = reference.run(prompt) if params.logprobs else ([], [])
    first = tokens[0] if tokens else reference.generate(prompt, params)[0]
    await w.commit(rid, RANGES, first, entries[0] if entries else None)


def test_a_split_request_and_a_local_one_decode_in_the_worlds_rounds(world, loop, reference):
    insts, senders, w = world
    prompt_a, prompt_d = _prompt(33, 41), _prompt(13, 42)
    want_a, want_d = reference.run(prompt_a), reference.run(prompt_d)

    async def run():
        await insts[1].add("d", prompt_d, GREEDY_LP)
        await _place_and_stream(w, senders, reference, "a", prompt_a, GREEDY_LP)
        outs = await asyncio.gather(*[_collect(insts[0], "a"), _collect(insts[1], "d")])
        w.release("a", RANGES)
        return outs

    out_a, out_d = loop.run_until_complete(run())
    assert_same_run(_tokens(out_a), _logprobs(out_a), want_a, "a (split)")
    assert_same_run(_tokens(out_d), _logprobs(out_d), want_d, "d (instance 1's own)")
    # every round together: the counts agree once the round in flight at the streams' end
    # has finished on both instances (read at once, one could still be one round ahead)
    async def together() -> bool:
        for _ in range(200):
            if insts[0].rounds == insts[1].rounds:
                return True
            await asyncio.sleep(0.05)
        return False

    assert w.rounds > 0 and loop.run_until_complete(together()), (insts[0].rounds,
                                                                  insts[1].rounds)

    async def drained():
        for _ in range(200):   # the Release round has to run; then both are empty
            held = [h for inst in insts for h in await inst.held()]
            if all(h.empty and h.free_blocks == 24 for h in held):
                return held
            await asyncio.sleep(0.05)
        return held

    assert all(h.empty and h.free_blocks == 24 for h in loop.run_until_complete(drained()))


def test_a_lost_holder_ends_the_split_stream_with_holder_lost(world, loop, reference):
    insts, senders, w = world
    prompt = _prompt(33, 43)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = reference.generate(prompt, params)

    async def run():
        await _place_and_stream(w, senders, reference, "b", prompt, params)
        got, error = [], None
        try:
            async for delta in insts[0].stream("b"):
                got += delta.new_token_ids
                if len(got) >= 3 and insts[1].ranks:
                    ray.kill(insts[1].ranks[0])   # the holder dies mid-decode
        except HolderLost as e:
            error = e
        return got, error

    got, error = loop.run_until_complete(run())
    assert isinstance(error, InstanceLost) and "holding part of its KV" in str(error)
    assert 3 <= len(got) < len(want) and got == want[:len(got)]


async def _collect(inst, request_id: str) -> list:
    return [out async for out in inst.stream(request_id)]
