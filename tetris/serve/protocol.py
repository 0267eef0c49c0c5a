"""The OpenAI-compatible wire format at the HTTP boundary.

Pydantic models live here and only here (the rest of Tetris speaks msgspec). This module turns an
OpenAI request into a validated ``GenerateRequest`` and turns results into OpenAI response bodies,
streaming chunks and error bodies. It knows no Ray and no model: the ingress calls it.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from tetris.sampling_params import SamplingParams
from tetris.token_ids import TokenIds, compact_tokens

__all__ = [
    "ProtocolError",
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "GenerateRequest",
    "to_sampling_params",
    "error_body",
    "sse",
    "SSE_DONE",
]

SSE_DONE = b"data: [DONE]\n\n"


class ProtocolError(Exception):
    """A request the server refuses; becomes an OpenAI error body with ``status``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type, self.code, self.headers = type, code, headers or {}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields common to completions and chat completions (OpenAI names and defaults)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM-compatible); 0 disables
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class GenerateRequest(msgspec.Struct, frozen=True):
    """What the ingress hands to the dispatcher: token ids and validated sampling parameters.

    ``prompt_token_ids`` may be given as any sequence of ints; it is kept as one int32 buffer
    (``compact_tokens``), the form every internal hop carries (a 100k-token prompt is 400 KB,
    not 3.6 MB of Python ints). An ``array('i')`` is kept as is, so ``structs.replace`` and
    unpickling do not copy it.
    """

    request_id: str
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    arrival_time: float = 0.0

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "prompt_token_ids",
                                      compact_tokens(self.prompt_token_ids))


def to_sampling_params(req: _SamplingFields, *, default_max_tokens: int) -> SamplingParams:
    """Map OpenAI fields onto ``SamplingParams``; invalid values become a 400 naming the field."""
    if req.n != 1:
        raise ProtocolError("only n=1 is supported", param="n")
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
        )
    except ValueError as e:
        # SamplingParams messages start with the field name ("top_p must be ...").
        raise ProtocolError(str(e), param=str(e).split(" ", 1)[0]) from None


def error_body(err: ProtocolError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def now() -> int:
    return int(time.time())
