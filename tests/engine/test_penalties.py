"""The sampling parameters vLLM clients send, each with its effect on the tiny model's output
checked against a cache-free reference: repetition/presence/frequency penalties, min_tokens,
min_p, include_stop_str_in_output and special tokens in the text."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from tetris.engine.engine import LLMEngine
from tetris.model.tokenizer import ByteTokenizer
from tetris.sampling_params import SamplingParams

from engine_helpers import causal_op
from engine_helpers import tiny_model as _load_tiny

PROMPT = [72, 101, 108, 108, 111, 72, 101, 108]


@pytest.fixture(scope="module")
def tiny_model():
    return _load_tiny()


def _generate(model, tok, prompt, **kw):
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    return engine.generate([prompt], SamplingParams(**kw))[0]


@torch.inference_mode()
def penalized_greedy(model, prompt, n, *, rep=1.0, presence=0.0, frequency=0.0):
    """Greedy tokens with the penalties applied as vLLM and OpenAI define them, recomputing
    the whole sequence each step."""
    tokens = list(prompt)
    for _ in range(n):
        hidden = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), causal_op)
        row = model.logits(hidden[-1:])[0].float()
        out = tokens[len(prompt):]
        for t in set(tokens):
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        for t in set(out):
            row[t] -= frequency * out.count(t) + presence
        tokens.append(int(row.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("kw", [dict(rep=1.8), dict(presence=2.0), dict(frequency=1.5),
                                dict(presence=-1.0, frequency=0.5, rep=0.7)])
def test_penalties_change_greedy_output_as_the_reference_does(tiny_model, kw):
    model, tok = tiny_model
    n = 16
    plain = penalized_greedy(model, PROMPT, n)
    expected = penalized_greedy(model, PROMPT, n, **kw)
    assert expected != plain, "the penalty must change this output (else the test shows nothing)"
    got = _generate(model, tok, PROMPT, max_tokens=n, temperature=0, ignore_eos=True,
                    repetition_penalty=kw.get("rep", 1.0),
                    presence_penalty=kw.get("presence", 0.0),
                    frequency_penalty=kw.get("frequency", 0.0))
    assert list(got.token_ids) == expected


def test_min_tokens_keeps_stop_tokens_out_until_reached(tiny_model):
    model, tok = tiny_model
    plain = penalized_greedy(model, PROMPT, 8)
    stop = plain[0]   # the greedy first token, made a stop token
    short = _generate(model, tok, PROMPT, max_tokens=8, temperature=0, stop_token_ids=(stop,))
    assert list(short.token_ids) == [stop] and short.finish_reason == "stop"
    got = _generate(model, tok, PROMPT, max_tokens=8, temperature=0, stop_token_ids=(stop,),
                    min_tokens=4)
    assert len(got.token_ids) >= 4
    assert stop not in got.token_ids[:4]


def _collect(model, tok, prompt, params):
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    engine.add_request("r", prompt, params)
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
    return tokens, logprobs


def test_min_p_keeps_only_tokens_near_the_most_likely(tiny_model):
    model, tok = tiny_model
    min_p = 0.75   # the tiny model is near uniform: only a close call survives
    changed = False
    for seed in range(4):
        # temperature 1: the sampler's probabilities are the raw ones the logprobs report
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True,
                                logprobs=1)
        free, _ = _collect(model, tok, PROMPT, params)
        tokens, logprobs = _collect(model, tok, PROMPT,
                                    msgspec.structs.replace(params, min_p=min_p))
        for e in logprobs:
            assert e.logprob >= math.log(min_p) + e.top[0][1] - 1e-6
        changed |= tokens != free
    assert changed, "min_p must change some sampled output"


def test_stop_string_kept_with_include_stop_str_in_output(tiny_model):
    model, _ = tiny_model
    tok = ByteTokenizer(320)
    text = tok.decode(penalized_greedy(model, PROMPT, 12))
    stop = text[3:5]
    assert stop and stop not in text[:4]
    cut = _generate(model, tok, PROMPT, max_tokens=12, temperature=0, ignore_eos=True,
                    stop=(stop,))
    kept = _generate(model, tok, PROMPT, max_tokens=12, temperature=0, ignore_eos=True,
                     stop=(stop,), include_stop_str_in_output=True)
    assert cut.text == text[:text.index(stop)]
    assert kept.text == text[:text.index(stop) + len(stop)]
