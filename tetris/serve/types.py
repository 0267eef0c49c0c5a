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
``prompt_token_ids`` (a tuple or list of ints, or an int32 ``array('i')``). On its way to the
server (pickled by Ray) the ids travel as one int32 buffer, whatever the caller gave, so the
ingress never holds a long prompt as Python int objects. Bad input raises ``ValueError`` with
the same message an HTTP client would get in its error body; overload raises
``tetris.serve.backend.Overloaded``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tetris.engine.request import TokenLogprob
from tetris.sampling_params import SamplingParams
from tetris.token_ids import compact_tokens

__all__ = ["GenerationRequest", "Generation", "GenerationDelta"]


class GenerationRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    sampling: SamplingParams = SamplingParams()
    request_id: str | None = None   # default: a fresh one

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")

    def __reduce__(self):
        """Pickled with the prompt as one int32 buffer (4 bytes a token, no objects).

        A tuple of Python ints unpickles into one int object per token past 256 (32 bytes of
        pymalloc each): a burst of long prompts in flight then leaves the ingress holding
        pymalloc arenas that a few later survivors pin (docs/soak.md). Ids that are not int32
        integers travel as given, so the server rejects them with the API's own error."""
        ids = self.prompt_token_ids
        if ids is not None:
            try:
                ids = compact_tokens(ids)
            except ValueError:
                pass
        return (type(self), (self.prompt, ids, self.sampling, self.request_id))


class Generation(msgspec.Struct, frozen=True):
    """The whole result of a unary call."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] = ()   # one per token with ``sampling.logprobs``


class GenerationDelta(msgspec.Struct, frozen=True):
    """One streamed step: the new tokens and text, and whether the request is done."""

    request_id: str
    new_text: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    new_logprobs: tuple[TokenLogprob, ...] = ()   # one per new token with ``sampling.logprobs``
