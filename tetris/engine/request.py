"""Per-request state of the engine and what a step reports back.

Lifecycle of a ``Sequence``:

1. ``WAITING``: queued; holds no KV blocks.
2. ``RUNNING``: admitted by the batcher with blocks for all its tokens; each step computes its
   not-yet-computed tokens (a prompt may take several steps under the token budget) and, once
   every token is computed, samples one new token.
3. ``WAITING`` again if preempted when blocks run out: its blocks are freed and its prompt plus
   generated tokens are recomputed on readmission (generated tokens are kept).
4. ``FINISHED`` with a reason: ``stop`` (stop token or stop string), ``length`` (max_tokens or
   the context limit) or ``abort``. Finished sequences hold no blocks.

Disaggregated prefill enters at 2 instead of 1: ``RECEIVING`` while a prefill instance writes
the prompt's KV into blocks reserved for it, then ``RUNNING`` with the first token (sampled by
the prefill side) once the engine is told that the KV is complete.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import msgspec

from tetris.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["FinishReason", "SequenceStatus", "Sequence", "RequestOutput"]


class SequenceStatus(enum.Enum):
    RECEIVING = "receiving"  # holds blocks; its KV is being written by a prefill instance
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """OpenAI's ``finish_reason`` values (``abort`` is ours: the caller went away)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestOutput(msgspec.Struct, frozen=True):
    """What one step produced for one request.

    ``token_ids``/``text`` are cumulative; ``new_token_ids``/``new_text`` are this step's delta
    (for streaming). ``text`` excludes stop tokens and a matched stop string.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None = None


class Sequence:
    """Mutable engine-side state of one request.

    ``tokens`` holds prompt then generated tokens; ``num_computed`` of them have their KV in the
    cache. ``block_table`` lists the KV blocks in position order (owned by the block manager).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        generator: torch.Generator | None,
        stop_token_ids: frozenset[int],
        max_total_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.tokens: list[int] = list(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.stop_token_ids = stop_token_ids
        self.max_total_tokens = max_total_tokens
        self.num_computed = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.text = ""
        # Incremental detokenization: output ids [detok_start, detok_read) are the left context
        # of the next decode, and ids before detok_read are already in ``text``.
        self.detok_start = 0
        self.detok_read = 0
        # Characters of ``text`` already reported, so that a step's delta is text[sent:].
        self.text_sent = 0
        # A streamed delta must never contain what may turn out to be the start of a stop
        # string (it would be trimmed later), so up to len(longest stop) - 1 chars wait.
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1
        self.num_preemptions = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def to_output(self, new_token_ids: tuple[int, ...]) -> RequestOutput:
        ready = len(self.text)
        if not self.is_finished:
            ready -= self.hold_back
            # An incomplete UTF-8 sequence decodes to U+FFFD until its last byte arrives.
            while ready > self.text_sent and self.text[ready - 1] == "\ufffd":
                ready -= 1
        new_text = self.text[self.text_sent:max(ready, self.text_sent)]
        self.text_sent = max(ready, self.text_sent)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=tuple(self.output_token_ids),
            new_token_ids=new_token_ids,
            text=self.text,
            new_text=new_text,
            finished=self.is_finished,
            finish_reason=self.finish_reason.value if self.finish_reason else None,
        )

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, status={self.status.value})")
