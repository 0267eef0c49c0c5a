"""Many choices in one request (``n``, lists of prompts) and the exact request bodies of the
clients people point at the server: ``vllm bench serve`` and lm-evaluation-harness's
``local-completions`` (loglikelihood and generate_until)."""

from __future__ import annotations

import pytest

from openai_helpers import MODEL, client, post, reference_logprobs, run


def _ask(app, body, path="/v1/completions"):
    async def go():
        async with client(app) as c:
            return await post(c, path, body)

    status, out = run(go())
    assert status == 200, out
    return out


def _sig(choice) -> tuple:
    """What tells two outputs apart (many tiny-model tokens have no text): text and logprobs."""
    return choice["text"], tuple(choice["logprobs"]["token_logprobs"])


SAMPLED = {"model": MODEL, "max_tokens": 10, "temperature": 1.0, "ignore_eos": True,
           "logprobs": 0}


def test_n3_with_a_seed_is_reproducible_and_its_choices_differ(app):
    req = SAMPLED | {"prompt": "Tetris", "n": 3, "seed": 11}
    first, again = _ask(app, req), _ask(app, req)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    sigs = [_sig(c) for c in first["choices"]]
    assert sigs == [_sig(c) for c in again["choices"]]
    assert len(set(sigs)) == 3
    # choice i is the request with seed + i, as in vLLM
    for i in range(3):
        alone = _ask(app, SAMPLED | {"prompt": "Tetris", "seed": 11 + i})
        assert _sig(alone["choices"][0]) == sigs[i]
    assert first["usage"]["completion_tokens"] == 30
    assert first["usage"]["prompt_tokens"] == len("Tetris") + 1   # once, not per choice


@pytest.mark.parametrize("prompts", [["Tet", "ris fills"], [[256, 84, 101], [256, 114, 105, 115]]],
                         ids=["strings", "token-id lists"])
def test_a_list_of_prompts_numbers_choices_prompt_major(app, prompts):
    body = _ask(app, SAMPLED | {"prompt": prompts, "n": 2, "seed": 4})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for j in range(2):
            alone = _ask(app, SAMPLED | {"prompt": prompt, "seed": 4 + j})
            assert _sig(body["choices"][p * 2 + j]) == _sig(alone["choices"][0])
    lengths = [len(p) + 1 if isinstance(p, str) else len(p) for p in prompts]
    assert body["usage"] == {"prompt_tokens": sum(lengths), "completion_tokens": 40,
                             "total_tokens": sum(lengths) + 40}


def test_streamed_choices_interleave_under_their_indices(app):
    req = SAMPLED | {"prompt": ["ab", "cd"], "n": 2, "seed": 9}
    unary = _ask(app, req)
    events = _ask(app, req | {"stream": True, "stream_options": {"include_usage": True}})
    for c in unary["choices"]:
        mine = [e["choices"][0] for e in events if e["choices"] and
                e["choices"][0]["index"] == c["index"]]
        assert "".join(m["text"] for m in mine) == c["text"]
        lps = [x for m in mine for x in m["logprobs"]["token_logprobs"]]
        assert lps == c["logprobs"]["token_logprobs"]
        assert mine[-1]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"] == unary["usage"]


def test_vllm_bench_serve_bodies(app):
    """As ``vllm bench serve`` sends them (openai-completions and openai-chat backends)."""
    comp = _ask(app, {"model": MODEL, "prompt": "Tetris fills the gaps", "max_tokens": 12,
                      "temperature": 0.0, "best_of": 1, "logprobs": None, "ignore_eos": True,
                      "stream": True, "stream_options": {"include_usage": True,
                                                         "continuous_usage_stats": True}})
    chunks = [e for e in comp if e["choices"]]
    assert all("usage" in e for e in comp)
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] == 12
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert comp[-1]["choices"] == [] and comp[-1]["usage"]["completion_tokens"] == 12
    chat = _ask(app, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Tetris fills the gaps"}]}], "temperature": 0.0,
        "max_completion_tokens": 12, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}, path="/v1/chat/completions")
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[-1]["usage"]["completion_tokens"] == 12
    assert [e["choices"][0]["finish_reason"] for e in chat if e["choices"]][-1] == "length"


def _lm_eval_loglikelihood(choice, ctxlen: int, drop_last: bool) -> tuple[float, bool]:
    """lm-evaluation-harness's parse of one choice: the continuation's summed logprob and
    whether every continuation token was the most likely one."""
    lp = choice["logprobs"]
    end = -1 if drop_last else None
    tokens, tops = lp["token_logprobs"][ctxlen:end], lp["top_logprobs"][ctxlen:end]
    return sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_bodies(app, backend, max_tokens):
    """``local-completions`` with token ids: context + continuation per prompt, echo,
    logprobs 1 (max_tokens 1, as lm-eval sends it, drops the generated token itself)."""
    tok = backend.tokenizer
    pairs = [("The capital of France is", " Paris"), ("Tetris fills", " the gaps")]
    prompts = [tok.encode(ctx) + tok.encode(cont, add_bos=False) for ctx, cont in pairs]
    body = _ask(app, {"model": MODEL, "prompt": prompts, "max_tokens": max_tokens,
                      "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234})
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for (ctx, cont), ids, choice in zip(pairs, prompts, choices):
        ctxlen = len(tok.encode(ctx))
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + max_tokens
        total, greedy = _lm_eval_loglikelihood(choice, ctxlen, drop_last=max_tokens == 1)
        ref = reference_logprobs(backend.engine.model, ids)
        expected = sum(float(ref[j - 1, ids[j]]) for j in range(ctxlen, len(ids)))
        assert abs(total - expected) < 1e-3
        assert greedy == all(int(ref[j - 1].argmax()) == ids[j] for j in range(ctxlen, len(ids)))
    assert body["usage"]["completion_tokens"] == (0 if max_tokens == 0 else 2)


def test_lm_eval_generate_until_bodies(app):
    prompts = ["Question: what fills the gaps?\nAnswer:", "Tetris"]
    body = _ask(app, {"model": MODEL, "prompt": prompts, "max_tokens": 24, "stop": ["\n\n", "Q"],
                      "temperature": 0, "seed": 1234})
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        assert c["finish_reason"] in ("stop", "length")
        assert "\n\n" not in c["text"] and "Q" not in c["text"]
        assert c["logprobs"] is None
