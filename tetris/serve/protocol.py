"""The OpenAI-compatible wire format at the HTTP boundary.

Pydantic models live here and only here (the rest of Tetris speaks msgspec). The request models
list every field the server takes, OpenAI's and vLLM's extras alike, and nothing else: an
unknown field is a 400 naming it (``extra="forbid"``; ``tetris.serve.fields`` says why for the
known ones it refuses), never silently dropped. ``tetris.serve.fields`` turns a request into
``SamplingParams``; this module knows no Ray and no model: the ingress calls it.
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
    "StreamOptions",
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
    continuous_usage_stats: bool = False   # vLLM: usage in every chunk


class _SamplingFields(BaseModel):
    """Fields common to completions and chat completions (OpenAI names and defaults; the
    vLLM extensions as vLLM names them). ``None`` is the default wherever a client may send
    ``null``."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None   # 1.0
    top_p: float | None = None         # 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None               # 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None            # accepted, no effect on generation
    # vLLM's extra sampling parameters
    top_k: int | None = None           # 0 or -1: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False


class CompletionRequest(_SamplingFields):
    # one prompt (text or token ids) or a batch (texts or token-id lists): a choice per prompt
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None        # top-N per token; 0: the token's own only
    best_of: int | None = None         # only == n: no server-side ranking


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None            # handed to the chat template


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None   # {"type": "text"} only
    store: bool | None = False         # true is refused: nothing is stored
    metadata: dict[str, str] | None = None   # tags of stored completions: no-op


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
    """Map a request's fields onto ``SamplingParams`` (``tetris.serve.fields``)."""
    from tetris.serve.fields import sampling_params

    return sampling_params(req, default_max_tokens=default_max_tokens)


def error_body(err: ProtocolError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def now() -> int:
    return int(time.time())
