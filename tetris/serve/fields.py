"""What the server does with each request field: honour it, or refuse it with a 400 naming it.

``sampling_params`` maps an OpenAI/vLLM request onto ``SamplingParams``; every value it cannot
honour is a ``ProtocolError`` whose ``param`` is the field. ``UNSUPPORTED`` says why for the
fields of the OpenAI spec and of vLLM that the server knows and refuses (the request models
forbid them, like any unknown field); ``refusal_for_extra`` words the 400 for either.

A backend may serve less than the engine can (``GenerationBackend.unsupported``: sampling
field -> why); ``check_backend`` refuses a request that needs it. The Ray cluster, whose prefill
pool samples the first token without the whole prompt at hand, declares ``CLUSTER_UNSUPPORTED``.
docs/serving.md has the table of every field.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from tetris.sampling_params import SamplingParams
from tetris.serve.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError

__all__ = ["sampling_params", "UNSUPPORTED", "refusal_for_extra", "check_backend",
           "CLUSTER_UNSUPPORTED", "cluster_unsupported", "MAX_N", "prompt_only"]

MAX_N = 64   # choices per request (n times prompts), as one request fans out to that many

_TOOLS = "tool and function calling is not supported"
_GUIDED = "guided (structured) decoding is not supported"
UNSUPPORTED: dict[str, str] = {
    "tools": _TOOLS, "tool_choice": _TOOLS, "functions": _TOOLS, "function_call": _TOOLS,
    "parallel_tool_calls": _TOOLS, "tool_calls": _TOOLS, "tool_call_id": _TOOLS,
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix (text after the insertion point) is not supported",
    "prompt_logprobs": "use echo with logprobs for the prompt's logprobs",
    "guided_json": _GUIDED, "guided_regex": _GUIDED, "guided_choice": _GUIDED,
    "guided_grammar": _GUIDED, "guided_decoding_backend": _GUIDED,
    "guided_whitespace_pattern": _GUIDED, "structured_outputs": _GUIDED,
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "bad_words": "bad_words is not supported",
    "logits_processors": "custom logits processors are not supported",
    "truncate_prompt_tokens": "prompts are never truncated: a prompt too long is a 400",
    "return_tokens_as_token_ids": "logprob tokens are always returned as text",
    "audio": "audio is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no reasoning mode",
    "web_search_options": "web search is not supported",
    "chat_template": "the model's own chat template is always used",
    "chat_template_kwargs": "the model's own chat template is always used",
    "add_generation_prompt": "the generation prompt is always added",
    "continue_final_message": "a final assistant message cannot be continued",
}

# SamplingParams field -> (request field it comes from, why the Ray cluster cannot serve it)
CLUSTER_UNSUPPORTED: dict[str, tuple[str, str]] = {
    "prompt_logprobs": ("echo", "echo with logprobs needs the prompt's logprobs: prompt "
                                "logprobs are served by the single-engine server only "
                                "(LocalEngineBackend), not by the Ray cluster"),
    "repetition_penalty": ("repetition_penalty", "repetition_penalty is served by the "
                           "single-engine server only: the prefill pool samples the first "
                           "token without the whole prompt at hand"),
    "min_tokens": ("min_tokens", "min_tokens is served by the single-engine server only: the "
                   "prefill pool samples the first token without the stop tokens at hand"),
}


def refusal_for_extra(field: str) -> ProtocolError:
    """The 400 for a field the request models do not take."""
    reason = UNSUPPORTED.get(field)
    if reason is not None:
        return ProtocolError(f"{field} is not supported: {reason}", param=field,
                             code="unsupported_field")
    return ProtocolError(f"unknown field {field!r}: this server does not take it "
                         f"(docs/serving.md lists the fields it honours)", param=field,
                         code="unknown_field")


def prompt_only(req) -> bool:
    """``max_tokens: 0`` with ``echo``: the prompt's text and logprobs, nothing generated
    (lm-evaluation-harness's loglikelihood requests)."""
    return isinstance(req, CompletionRequest) and bool(req.echo) and req.max_tokens == 0


def sampling_params(req, *, default_max_tokens: int) -> SamplingParams:
    """``SamplingParams`` of one choice of ``req``; a value it cannot honour is a 400 naming it.

    ``prompt_only`` requests generate one token, which the API drops (vLLM does the same).
    """
    _check_choices(req)
    if req.stream_options is not None and not req.stream:
        raise ProtocolError("stream_options is only allowed with stream: true",
                            param="stream_options")
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req)
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = req.logprobs
        prompt_logprobs = logprobs if req.echo else None
        if prompt_only(req):
            max_tokens = 1
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    top_k = req.top_k if req.top_k is not None else 0
    fields = dict(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=_or(req.temperature, 1.0), top_k=0 if top_k == -1 else top_k,
        top_p=_or(req.top_p, 1.0), min_p=_or(req.min_p, 0.0), seed=req.seed, stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos),
        min_tokens=_or(req.min_tokens, 0), repetition_penalty=_or(req.repetition_penalty, 1.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        skip_special_tokens=_or(req.skip_special_tokens, True),
        spaces_between_special_tokens=_or(req.spaces_between_special_tokens, True),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
    )
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        # SamplingParams messages start with the field name ("top_p must be ...").
        param = str(e).split(" ", 1)[0]
        if param == "logprobs" and isinstance(req, ChatCompletionRequest):
            param = "top_logprobs"
        elif param == "prompt_logprobs":
            param = "logprobs"
        raise ProtocolError(str(e), param=param) from None


def _or(value, default):
    return default if value is None else value


def _check_choices(req) -> None:
    n = _or(req.n, 1)
    if not 1 <= n <= MAX_N:
        raise ProtocolError(f"n must be in [1, {MAX_N}], got {n}", param="n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != n:
        if best_of < n:
            raise ProtocolError(f"best_of must be >= n, got best_of={best_of}, n={n}",
                                param="best_of")
        raise ProtocolError(f"best_of > n is not supported (no server-side ranking of extra "
                            f"samples): got best_of={best_of}, n={n}", param="best_of")


def _check_chat(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise ProtocolError("top_logprobs needs logprobs: true", param="top_logprobs")
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise ProtocolError(f"response_format {fmt.get('type')!r} is not supported: only "
                            f"{{\"type\": \"text\"}} (no JSON mode or schemas)",
                            param="response_format")
    if req.store:
        raise ProtocolError("store: true is not supported: this server stores no completions",
                            param="store")


def check_backend(sampling: SamplingParams, unsupported: Mapping[str, tuple[str, str]]) -> None:
    """Refuse what this backend cannot serve: any field of ``unsupported`` not at its default."""
    for field in sorted(unsupported):
        default = _DEFAULTS[field]
        if getattr(sampling, field) != default:
            param, reason = unsupported[field]
            raise ProtocolError(reason, param=param, code="unsupported_on_this_server")


def cluster_unsupported(deployment) -> dict[str, tuple[str, str]]:
    """What the Ray cluster of ``deployment`` cannot serve: ``CLUSTER_UNSUPPORTED``, and
    logprobs too when either side is emulated (it computes no logits)."""
    out = dict(CLUSTER_UNSUPPORTED)
    if "emulated" in (deployment.prefill.executor, deployment.decode.executor):
        out["logprobs"] = ("logprobs", "logprobs need a model: this deployment's prefill or "
                                       "decode side is emulated")
    return out


_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(SamplingParams)}
