"""Logprobs from the engine against log_softmax of a cache-free forward of the tiny model:
sampled tokens (greedy and random, top-N), prompt tokens (chunked prefill), and the first
token of a request prefilled elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from tetris.engine.engine import LLMEngine
from tetris.engine.request import TokenLogprob
from tetris.sampling_params import SamplingParams

from engine_helpers import causal_op
from engine_helpers import tiny_model as _load_tiny

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_model():
    return _load_tiny()


@torch.inference_mode()
def full_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: log_softmax of the logits at every position, one plain forward."""
    hidden = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), causal_op)
    return torch.log_softmax(model.logits(hidden).float(), dim=-1)


def assert_entry(entry: TokenLogprob, row: torch.Tensor, token: int, n: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - float(row[token])) < TOL
    vals, idx = torch.topk(row, n)
    assert [t for t, _ in entry.top] == idx.tolist()
    assert max(abs(a - b) for (_, a), b in zip(entry.top, vals.tolist())) < TOL if n else True


def _run(engine, prompt, params):
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_sampled_token_logprobs_are_the_raw_log_softmax(tiny_model, temperature):
    model, tok = tiny_model
    prompt = [5, 77, 13, 200, 9, 41]
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=7, ignore_eos=True,
                            logprobs=5)
    outs = _run(LLMEngine(model, tok, num_blocks=64, block_size=4), prompt, params)
    tokens = [t for o in outs for t in o.new_token_ids]
    entries = [e for o in outs for e in o.new_logprobs]
    assert len(entries) == len(tokens) == 6
    ref = full_logprobs(model, prompt + tokens)
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        assert_entry(entry, ref[len(prompt) + i - 1], token, 5)
    if temperature == 0.0:   # greedy: the token is always the top-1 of the raw logprobs
        assert all(e.top[0][0] == e.token_id for e in entries)


def test_no_logprobs_unless_asked(tiny_model):
    model, tok = tiny_model
    outs = _run(LLMEngine(model, tok, num_blocks=64), [1, 2, 3],
                SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert all(o.new_logprobs == () and o.prompt_logprobs is None for o in outs)


def test_prompt_logprobs_over_chunked_prefill(tiny_model):
    model, tok = tiny_model
    prompt = [(i * 37) % 250 + 1 for i in range(23)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3,
                            logprobs=0)
    # a budget of 8 tokens a step: the prompt prefills in three chunks
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    outs = _run(engine, prompt, params)
    given = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(given) == 1, "prompt logprobs come once"
    plp = given[0]
    assert len(plp) == len(prompt) and plp[0] is None
    ref = full_logprobs(model, prompt)
    for j in range(1, len(prompt)):
        assert_entry(plp[j], ref[j - 1], prompt[j], 3)
    # logprobs=0: the sampled token's logprob and no alternatives
    assert all(e.top == () for o in outs for e in o.new_logprobs)


def test_a_prefilled_request_reports_the_first_tokens_logprob_it_was_given(tiny_model):
    model, tok = tiny_model
    prompt = [3, 4, 5, 6]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2)
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    engine.reserve("p", prompt, params)
    with pytest.raises(ValueError, match="logprobs"):
        engine.commit_prefilled("p", 11)   # asked for logprobs, none given
    first = TokenLogprob(11, -0.5, ((11, -0.5), (12, -1.5)))
    engine.commit_prefilled("p", 11, first)
    out = engine.step()[0]
    assert out.new_token_ids == (11,) and out.new_logprobs == (first,)
    assert not math.isnan(out.new_logprobs[0].logprob)
