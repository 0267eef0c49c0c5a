"""A TP-2 decode instance's rounds go to rank 0 only; rank 0 runs them on rank 1 over their
lockstep socket. Rank 1 gets no Ray call per round, stays in step through idle periods longer
than the lockstep's timeout, and a rank killed mid-stream fails the instance's requests with
``DecodeInstanceLost`` (which the dispatcher resumes elsewhere) at once, not at a timeout."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import torch
from exactness import TOP, assert_same_run, engine_runs

from tetris.actors.decode.instance import DecodeInstance, DecodeInstanceLost
from tetris.config import DecodeConfig, DeploymentConfig, ModelConfig
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

MODEL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, seed=5)
DEPLOYMENT = DeploymentConfig(model=MODEL, decode=DecodeConfig(
    tp_size=2, max_batch_size=4, block_size=4, kv_blocks=64))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
GREEDY_LP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=TOP)
LOCKSTEP_TIMEOUT_S = 3.0   # rank 0's wait for replies; an idle follower's wait has none
TIMEOUT_S = 60.0           # the model's collectives: a death must surface well before


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model(MODEL)
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4, max_num_seqs=4)

    def tokens(prompt, params=GREEDY):
        return list(engine.generate([prompt], params)[0].token_ids)

    tokens.runs = lambda prompts: engine_runs(engine, prompts, GREEDY_LP)   # and logprobs
    return tokens


@pytest.fixture(scope="module")
def inst(ray_session, loop):
    inst = DecodeInstance(DEPLOYMENT, 5, transfer=None, timeout_s=TIMEOUT_S,
                          lockstep_timeout_s=LOCKSTEP_TIMEOUT_S)
    loop.run_until_complete(inst.start())
    yield inst
    loop.run_until_complete(inst.shutdown())


async def _generate(inst, rid: str, prompt: list[int], params=GREEDY) -> list[int]:
    await inst.add(rid, prompt, params)
    return [t async for out in inst.stream(rid) for t in out.new_token_ids]


async def _generate_with_logprobs(inst, rid: str, prompt: list[int]) -> tuple[list, list]:
    await inst.add(rid, prompt, GREEDY_LP)
    outs = [out async for out in inst.stream(rid)]
    return [t for o in outs for t in o.new_token_ids], [e for o in outs for e in o.new_logprobs]


def _counts(inst) -> list[dict]:
    return ray.get([r.control_counts.remote() for r in inst.ranks])


def test_followers_step_without_ray_calls_and_match_the_single_engine(inst, loop, reference):
    prompts = {"a": _prompt(5, 1), "b": _prompt(11, 2), "c": _prompt(17, 3)}
    before = _counts(inst)
    rounds = inst.rounds

    async def body():
        return await asyncio.gather(*[_generate_with_logprobs(inst, k, p)
                                      for k, p in prompts.items()])

    got = dict(zip(prompts, loop.run_until_complete(body())))
    for (k, run), want in zip(got.items(), reference.runs(list(prompts.values())), strict=True):
        assert_same_run(*run, want, k)
    after = _counts(inst)
    ran = inst.rounds - rounds
    assert ran >= GREEDY.max_tokens
    # one Ray call per round, to rank 0; rank 1 stepped as often, from rank 0's broadcast
    assert after[0]["ray_rounds"] - before[0]["ray_rounds"] == ran
    assert after[1]["ray_rounds"] == 0
    assert after[1]["steps"] - before[1]["steps"] == after[0]["steps"] - before[0]["steps"] == ran
    assert all(h.empty for h in loop.run_until_complete(inst.held()))


def test_an_idle_instance_outlives_the_lockstep_timeout(inst, loop, reference):
    """Idle longer than the lockstep's timeout: no rounds meanwhile, rank 1 still in step
    afterwards (its receive has no timeout to run out, unlike a gloo receive's)."""
    prompt = _prompt(9, 4)
    loop.run_until_complete(_generate(inst, "warm", prompt))
    rounds, steps = inst.rounds, _counts(inst)[1]["steps"]
    loop.run_until_complete(asyncio.sleep(LOCKSTEP_TIMEOUT_S * 1.5))
    assert inst.rounds == rounds and _counts(inst)[1]["steps"] == steps
    assert loop.run_until_complete(_generate(inst, "after-idle", prompt)) == reference(prompt)
    assert inst.broken is None


@pytest.mark.parametrize("victim", [1, 0], ids=["follower", "rank0"])
def test_a_rank_killed_mid_stream_fails_requests_at_once_and_restart_serves(
        inst, loop, reference, victim):
    """The stream raises ``DecodeInstanceLost`` (an ``InstanceLost``: the dispatcher runs the
    request again from the tokens its client has) long before any gloo timeout; after
    ``restart`` the instance decodes exactly as before."""
    prompt = _prompt(6, 5)
    long = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)

    async def body():
        await inst.add("long", prompt, long)
        stream = inst.stream("long")
        seen = [await anext(stream), await anext(stream)]
        assert not seen[-1].finished
        killed = time.monotonic()
        ray.kill(inst.ranks[victim])
        with pytest.raises(DecodeInstanceLost):
            async for out in stream:
                assert not out.finished, "the request finished beside a dead rank"
        return time.monotonic() - killed

    restarts = inst.restarts
    noticed_s = loop.run_until_complete(body())
    assert inst.broken is not None
    assert noticed_s < TIMEOUT_S / 2, noticed_s   # the sockets closed: no timeout waited out
    loop.run_until_complete(inst.restart())
    assert inst.restarts == restarts + 1 and inst.broken is None
    got = loop.run_until_complete(_generate_with_logprobs(inst, f"after-{victim}", prompt))
    assert_same_run(*got, reference.runs([prompt])[0], f"after-{victim}")
    assert _counts(inst)[1]["ray_rounds"] == 0
