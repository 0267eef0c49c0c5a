"""OpenAI wire format: requests map onto validated sampling parameters; errors are OpenAI-shaped."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tetris.serve.metrics import ServingMetrics
from tetris.serve.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    error_body,
    sse,
    to_sampling_params,
)


def test_completion_fields_map_onto_sampling_params():
    req = CompletionRequest(model="m", prompt="hi", max_tokens=7, temperature=0.0, top_p=0.9,
                            stop="\n", seed=3, top_k=5)
    sp = to_sampling_params(req, default_max_tokens=16)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (7, 0.0, 0.9, 5, 3)
    assert sp.stop == ("\n",) and sp.greedy


def test_defaults_and_chat_max_completion_tokens():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                max_completion_tokens=9)
    assert to_sampling_params(req, default_max_tokens=16).max_tokens == 9
    plain = CompletionRequest(model="m", prompt="x")
    assert to_sampling_params(plain, default_max_tokens=16).max_tokens == 16


@pytest.mark.parametrize(
    "fields, param",
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"n": 0}, "n"),
     ({"min_tokens": 99, "max_tokens": 5}, "min_tokens"), ({"min_p": 1.5}, "min_p"),
     ({"logprobs": 21}, "logprobs"), ({"best_of": 3}, "best_of")],
)
def test_invalid_sampling_values_become_400_naming_the_field(fields, param):
    req = CompletionRequest(model="m", prompt="x", **fields)
    with pytest.raises(ProtocolError) as e:
        to_sampling_params(req, default_max_tokens=16)
    assert e.value.status == 400 and e.value.param == param
    body = error_body(e.value)
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param


def test_chat_needs_messages_and_known_roles():
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[{"role": "robot", "content": "x"}])


def test_sse_framing():
    frame = sse({"a": 1})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[len(b"data: "):]) == {"a": 1}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_metrics_render_prometheus_text_with_tetris_prefix():
    m = ServingMetrics("tiny")
    m.observe_plan([2, 4])
    m.observe_first_token(0.5, 0.1, prompt_tokens=100)
    m.observe_finish(1.0, generated=5, reason="length")
    m.set_improvement_rate(0.3)
    text = m.render().decode()
    assert 'tetris:prefill_chunks_per_request_count{model_name="tiny"} 1.0' in text
    assert 'tetris:prefill_chunk_sp_size_count{model_name="tiny"} 2.0' in text
    assert 'tetris:prompt_tokens_total{model_name="tiny"} 100.0' in text
    assert 'tetris:improvement_rate{model_name="tiny"} 0.3' in text
    assert 'tetris:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in text
    # Two instances in one process keep separate registries.
    assert "tetris:prompt_tokens_total{model_name=\"tiny\"} 0.0" in ServingMetrics("tiny").render().decode()


def test_generate_request_keeps_the_prompt_as_one_int32_buffer():
    import msgspec
    import pickle
    from array import array

    from tetris.sampling_params import SamplingParams
    from tetris.serve.protocol import GenerateRequest

    ids = tuple(range(1000, 1500))
    req = GenerateRequest("r", ids, SamplingParams())
    assert isinstance(req.prompt_token_ids, array) and req.prompt_token_ids.typecode == "i"
    assert tuple(req.prompt_token_ids) == ids
    # neither replace nor a hop through pickle re-converts (or copies within the process)
    assert msgspec.structs.replace(req, stream=True).prompt_token_ids is req.prompt_token_ids
    back = pickle.loads(pickle.dumps(req))
    assert back == req and back.prompt_token_ids.typecode == "i"
    with pytest.raises(ValueError, match="int32"):
        GenerateRequest("r", (1, 2**40), SamplingParams())
