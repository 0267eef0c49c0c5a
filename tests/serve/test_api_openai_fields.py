"""Every request field of the OpenAI spec and vLLM's extras, one row each: a supported field
has an observable effect on the answer (or is a documented no-op, docs/serving.md), an
unsupported or unknown one is a 400 naming it, and the server goes on serving."""

from __future__ import annotations

import pytest

from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams

from openai_helpers import MODEL, client, post, run

PROMPT = "Tetris fills the gaps"
COMP = "/v1/completions"
CHAT = "/v1/chat/completions"


def _base(path: str) -> dict:
    if path == COMP:
        return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}


class Ctx:
    """What the checks compare against: the greedy baselines and a way to ask more."""

    def __init__(self, app, backend):
        self.app, self.backend = app, backend
        self.base = {p: self.ask(p, {}) for p in (COMP, CHAT)}
        ref = LLMEngine(backend.engine.model, backend.engine.tokenizer, num_blocks=64)
        ids = backend.tokenizer.encode(PROMPT)
        self.greedy_ids = list(ref.generate([ids], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids)
        self.eos_seed, self.eos_at = self._find(lambda t: t in backend.tokenizer.eos_token_ids)
        self.special_seed, _ = self._find(lambda t: t in (256, 258, 259))
        self.ref = ref

    def ask(self, path: str, fields: dict, *, status: int = 200):
        async def go():
            async with client(self.app) as c:
                return await post(c, path, _base(path) | fields)

        got, body = run(go())
        assert got == status, body
        return body

    def text(self, path: str, fields: dict) -> str:
        body = self.ask(path, fields)
        choice = body["choices"][0]
        return choice["text"] if path == COMP else choice["message"]["content"]

    def _find(self, wanted):
        """A seed whose 16 sampled tokens (temperature 1) hold a wanted token; its place."""
        ids = self.backend.tokenizer.encode(PROMPT)
        ref = LLMEngine(self.backend.engine.model, self.backend.engine.tokenizer, num_blocks=64)
        for seed in range(200):
            out = ref.generate([ids], SamplingParams(max_tokens=16, temperature=1.0, seed=seed,
                                                     ignore_eos=True))[0].token_ids
            hits = [i for i, t in enumerate(out) if wanted(t)]
            if hits and hits[0] < 14:
                return seed, hits[0]
        raise AssertionError("no seed gives the wanted token: pick another prompt")


@pytest.fixture(scope="module")
def ctx(app, backend):
    return Ctx(app, backend)


def _text(body, path=COMP):
    choice = body["choices"][0]
    return choice["text"] if path == COMP else choice["message"]["content"]


SAMPLED = {"temperature": 1.0, "seed": 1}


def _same_as_greedy(path=COMP):
    return lambda body, ctx: _text(body, path) == _text(ctx.base[path], path)


def _differs_from_greedy(body, ctx):
    """Many of the tiny vocabulary's tokens have no text: the logprobs (``LP0`` in the
    request) tell the outputs apart."""
    mine = body["choices"][0]["logprobs"]["token_logprobs"]
    greedy = ctx.ask(COMP, LP0 | {"max_tokens": len(mine)})
    assert mine != greedy["choices"][0]["logprobs"]["token_logprobs"]
    return True


LP0 = {"logprobs": 0}
# Penalties show once greedy output starts repeating itself: after ~25 tokens here.
LONG = LP0 | {"max_tokens": 32}


def _stop_string(ctx):
    text = _text(ctx.base[COMP])
    k = next(k for k in range(1, len(text) - 2) if text.find(text[k:k + 2]) == k)
    return text, text[k:k + 2], k


# (field, path, fields, check(body, ctx) -> truthy). Checks compare with ctx's baselines.
SUPPORTED = [
    ("max_tokens", COMP, {"max_tokens": 3}, lambda b, c: b["usage"]["completion_tokens"] == 3),
    ("temperature", COMP, SAMPLED | LP0, _differs_from_greedy),
    ("top_p", COMP, SAMPLED | {"top_p": 1e-6}, _same_as_greedy()),
    ("top_k", COMP, SAMPLED | {"top_k": 1}, _same_as_greedy()),
    ("top_k=-1 is off (vLLM)", COMP, SAMPLED | {"top_k": -1},
     lambda b, c: _text(b) == c.text(COMP, SAMPLED)),
    ("min_p", COMP, SAMPLED | {"min_p": 1.0}, _same_as_greedy()),
    ("seed", COMP, {"temperature": 1.0, "seed": 5},
     lambda b, c: _text(b) == c.text(COMP, {"temperature": 1.0, "seed": 5})
     != c.text(COMP, {"temperature": 1.0, "seed": 6})),
    ("stop", COMP, None, lambda b, c: True),   # fields filled in by the test (need the text)
    ("include_stop_str_in_output", COMP, None, lambda b, c: True),
    ("stop_token_ids", COMP, None, lambda b, c: True),
    ("min_tokens", COMP, None, lambda b, c: True),
    ("ignore_eos", COMP, None, lambda b, c: True),
    ("repetition_penalty", COMP, {"repetition_penalty": 1.8} | LONG, _differs_from_greedy),
    ("presence_penalty", COMP, {"presence_penalty": 2.0} | LONG, _differs_from_greedy),
    ("frequency_penalty", COMP, {"frequency_penalty": 2.0} | LONG, _differs_from_greedy),
    ("n", COMP, SAMPLED | {"n": 2} | LP0,
     lambda b, c: [ch["index"] for ch in b["choices"]] == [0, 1]
     and b["choices"][0]["logprobs"] != b["choices"][1]["logprobs"]),
    ("best_of == n", COMP, SAMPLED | {"n": 2, "best_of": 2}, lambda b, c: len(b["choices"]) == 2),
    ("echo", COMP, {"echo": True}, lambda b, c: _text(b) == PROMPT + _text(c.base[COMP])),
    ("logprobs", COMP, {"logprobs": 2},
     lambda b, c: len(b["choices"][0]["logprobs"]["token_logprobs"]) == 8
     and all(1 <= len(t) <= 3 for t in b["choices"][0]["logprobs"]["top_logprobs"])),
    ("stream", COMP, {"stream": True},
     lambda b, c: "".join(e["choices"][0]["text"] for e in b if e["choices"])
     == _text(c.base[COMP])),
    ("stream_options.include_usage", COMP,
     {"stream": True, "stream_options": {"include_usage": True}},
     lambda b, c: b[-1]["choices"] == [] and b[-1]["usage"]["completion_tokens"] == 8
     and all("usage" not in e for e in b[:-1])),
    ("stream_options.continuous_usage_stats", COMP,
     {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     lambda b, c: [e["usage"]["completion_tokens"] for e in b] == sorted(
         e["usage"]["completion_tokens"] for e in b) and b[-1]["usage"]["completion_tokens"] == 8),
    ("skip_special_tokens", COMP, None, lambda b, c: True),
    ("spaces_between_special_tokens", COMP, None, lambda b, c: True),
    ("user (no-op)", COMP, {"user": "u-1"}, _same_as_greedy()),
    ("max_completion_tokens", CHAT, {"max_completion_tokens": 3},
     lambda b, c: b["usage"]["completion_tokens"] == 3),
    ("chat logprobs + top_logprobs", CHAT, {"logprobs": True, "top_logprobs": 2},
     lambda b, c: len(b["choices"][0]["logprobs"]["content"]) == 6
     and all(len(t["top_logprobs"]) == 2 for t in b["choices"][0]["logprobs"]["content"])),
    ("response_format text (no-op)", CHAT, {"response_format": {"type": "text"}},
     _same_as_greedy(CHAT)),
    ("metadata (no-op)", CHAT, {"metadata": {"team": "a"}}, _same_as_greedy(CHAT)),
    ("store false (no-op)", CHAT, {"store": False}, _same_as_greedy(CHAT)),
    ("message name (to the template)", CHAT,
     {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, _same_as_greedy(CHAT)),
    ("chat stream", CHAT, {"stream": True},
     lambda b, c: b[0]["choices"][0]["delta"]["role"] == "assistant"
     and "".join(e["choices"][0]["delta"].get("content", "") for e in b)
     == _text(c.base[CHAT], CHAT)),
]


def _filled(field: str, ctx: Ctx):
    """The rows whose fields and checks need the baseline's text or ids."""
    text, stop, k = _stop_string(ctx)
    first = ctx.greedy_ids[0]
    eos = {"temperature": 1.0, "seed": ctx.eos_seed, "max_tokens": 16}
    special = {"temperature": 1.0, "seed": ctx.special_seed, "max_tokens": 16}
    rows = {
        "stop": ({"stop": [stop]}, lambda b: _text(b) == text[:k]
                 and b["choices"][0]["finish_reason"] == "stop"),
        "include_stop_str_in_output": ({"stop": stop, "include_stop_str_in_output": True},
                                       lambda b: _text(b) == text[:k + 2]),
        "stop_token_ids": ({"stop_token_ids": [first]},
                           lambda b: b["usage"]["completion_tokens"] == 1
                           and b["choices"][0]["finish_reason"] == "stop"),
        "min_tokens": ({"stop_token_ids": [first], "min_tokens": 4},
                       lambda b: b["usage"]["completion_tokens"] >= 4),
        "ignore_eos": (eos | {"ignore_eos": False},
                       lambda b: b["usage"]["completion_tokens"] == ctx.eos_at + 1
                       and b["choices"][0]["finish_reason"] == "stop"
                       and ctx.ask(COMP, eos)["usage"]["completion_tokens"] == 16),
        "skip_special_tokens": (special | {"skip_special_tokens": False},
                                lambda b: "<|" in _text(b)
                                and "<|" not in ctx.text(COMP, special)),
        "spaces_between_special_tokens": (
            special | {"skip_special_tokens": False, "spaces_between_special_tokens": False},
            lambda b: _text(b) != ctx.text(COMP, special | {"skip_special_tokens": False})
            and _text(b).replace("<|", " <|") != _text(b)),
    }
    return rows[field]


@pytest.mark.parametrize("field, path, fields, check", SUPPORTED, ids=[r[0] for r in SUPPORTED])
def test_a_supported_field_has_its_effect(ctx, field, path, fields, check):
    if fields is None:
        fields, filled = _filled(field, ctx)
        body = ctx.ask(path, fields)
        assert filled(body), body
        return
    body = ctx.ask(path, fields)
    assert check(body, ctx), body


UNSUPPORTED = [
    (COMP, {"tools": [{"type": "function"}]}, "tools"),
    (COMP, {"tool_choice": "auto"}, "tool_choice"),
    (COMP, {"functions": []}, "functions"),
    (COMP, {"function_call": "auto"}, "function_call"),
    (COMP, {"logit_bias": {"50": 10}}, "logit_bias"),
    (COMP, {"suffix": "end"}, "suffix"),
    (COMP, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (COMP, {"guided_json": {"type": "object"}}, "guided_json"),
    (COMP, {"guided_regex": "a+"}, "guided_regex"),
    (COMP, {"guided_choice": ["a", "b"]}, "guided_choice"),
    (COMP, {"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    (COMP, {"use_beam_search": True}, "use_beam_search"),
    (COMP, {"best_of": 3}, "best_of"),
    (COMP, {"max_tokens": 0}, "max_tokens"),   # without echo nothing would be returned
    (COMP, {"frobnicate": 1}, "frobnicate"),
    (COMP, {"stream_options": {"include_usage": True}}, "stream_options"),   # without stream
    (COMP, {"stream": True, "stream_options": {"bogus": True}}, "stream_options.bogus"),
    (CHAT, {"tools": [{"type": "function"}]}, "tools"),
    (CHAT, {"tool_choice": "none"}, "tool_choice"),
    (CHAT, {"parallel_tool_calls": False}, "parallel_tool_calls"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    (CHAT, {"store": True}, "store"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),   # without logprobs: true
    (CHAT, {"logit_bias": {"1": 1}}, "logit_bias"),
    (CHAT, {"audio": {}}, "audio"),
    (CHAT, {"modalities": ["text"]}, "modalities"),
    (CHAT, {"guided_json": {}}, "guided_json"),
    (CHAT, {"echo": True}, "echo"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
     "messages.0.tool_calls"),
]


@pytest.mark.parametrize("path, fields, param", UNSUPPORTED,
                         ids=[f"{p.split('/')[-1]}-{r}" for p, _, r in UNSUPPORTED])
def test_an_unsupported_field_is_a_400_naming_it(ctx, path, fields, param):
    body = ctx.ask(path, fields, status=400)
    err = body["error"]
    assert err["param"] == param and param.split(".")[-1] in err["message"], err
    assert err["type"] == "invalid_request_error"
    after = ctx.ask(path, {})   # and the server keeps serving
    assert _text(after, path) == _text(ctx.base[path], path)
