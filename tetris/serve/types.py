"""Typed request and response structs of the Python handle API (other Ray apps call these).

    from ray import serve
    from tetris.serve.types import Generation, GenerationRequest
    from tetris.sampling_params import SamplingParams

    handle = serve.get_app_handle("tetris")
    req = GenerationRequest(prompt="Tetris fills the gaps", sampling=SamplingParams(max_tokens=16))
    result: Generation = await handle.generate.remote(req)               # unary
    async for piece in handle.options(stream=True).generate_stream.remote(req):
        print(piece.new_text, end="")                                       # GenerationDelta

A request carries either ``prompt`` (text, tokenized by the server, BOS added) or
``prompt_token_ids``. Bad input raises ``ValueError`` with the same message an HTTP client
would get in its error body; overload raises ``tetris.serve.backend.Overloaded``.
"""

from __future__ import annotations

import msgspec

from tetris.sampling_params import SamplingParams

__all__ = ["GenerationRequest", "Generation", "GenerationDelta"]


class GenerationRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = SamplingParams()
    request_id: str | None = None   # default: a fresh one

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")


class Generation(msgspec.Struct, frozen=True):
    """The whole result of a unary call."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str | None


class GenerationDelta(msgspec.Struct, frozen=True):
    """One streamed step: the new tokens and text, and whether the request is done."""

    request_id: str
    new_text: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
