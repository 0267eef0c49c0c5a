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
from array import array
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import msgspec

from tetris.sampling_params import SamplingParams
from tetris.token_ids import compact_tokens

if TYPE_CHECKING:
    import torch

__all__ = ["FinishReason", "SequenceStatus", "Sequence", "RequestOutput", "Tokens", "TokenLogprob",
           "OutputDelta", "Transcript"]


class Tokens:
    """A sequence's token ids: the prompt as one int32 buffer, then the generated ids.

    4 bytes a prompt token. The prompt used to be kept as a tuple and again inside a list of
    Python ints, ~44 bytes a token (two pointers and the int object past 256): 4.4 MB for a
    100k-token prompt, on every decode rank, for the request's whole life. Indexing and slicing
    read like a list (ints, lists); only ``append`` mutates, and only the generated part.
    """

    __slots__ = ("prompt", "generated")

    def __init__(self, prompt: array) -> None:
        self.prompt = prompt
        self.generated: list[int] = []

    def __len__(self) -> int:
        return len(self.prompt) + len(self.generated)

    def append(self, token: int) -> None:
        self.generated.append(token)

    def __iter__(self) -> Iterator[int]:
        yield from self.prompt
        yield from self.generated

    def __getitem__(self, i):
        p = len(self.prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            if stop <= p:
                return self.prompt[start:stop].tolist()
            if start >= p:
                return self.generated[start - p:stop - p]
            return self.prompt[start:].tolist() + self.generated[:stop - p]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"token index {i} out of range for {n} tokens")
        return self.prompt[i] if i < p else self.generated[i - p]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Tokens):
            return self.prompt == other.prompt and self.generated == other.generated
        try:
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        except TypeError:
            return NotImplemented

    __hash__ = None   # mutable

    def __repr__(self) -> str:
        return f"Tokens(prompt={len(self.prompt)}, generated={self.generated!r})"


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


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """Log-probabilities at one position: of the token there, and the ``top`` most likely tokens
    as (token id, logprob), most likely first (as many as the request asked for).

    Read off the raw logits (log-softmax before penalties, temperature, top-k/p: vLLM's
    default), so they describe the model, not the sampler (``tetris.engine.logprobs``).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    # one per token of ``new_token_ids`` when the request asked for logprobs, else empty
    new_logprobs: tuple[TokenLogprob, ...] = ()
    # with ``prompt_logprobs``: once, in the first output after the prefill; the first prompt
    # token has none (nothing precedes it)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class OutputDelta(msgspec.Struct, frozen=True, array_like=True):
    """One streamed step of one request: only what is new since the previous one.

    What every serving hop streams (decode ranks -> decode instance -> dispatcher -> ingress).
    A ``RequestOutput`` repeats every output token and all the text so far, so streaming it
    costs O(tokens so far) per token and hop: a pickle round trip took 57 us at 2k output
    tokens, 0.22 ms at 8k and 1.4 ms at 32k, against 2.6 us for a delta (one run of
    ``benchmarks/bench_stream_delta.py`` on the 2-core development machine). ``num_tokens``
    counts the output tokens so far, these included: a consumer checks with it that no delta
    was lost, and needs no list of its own to know the count. ``Transcript`` rebuilds the
    cumulative output where one is wanted (a non-streaming response). ``new_logprobs`` and
    ``prompt_logprobs`` as in ``RequestOutput``.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    num_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    new_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # Prompt tokens whose KV came from a prefix cache (set on a request's first delta by the
    # served system's dispatcher; usage.prompt_tokens_details.cached_tokens)
    cached_tokens: int = 0

    @classmethod
    def of(cls, out: RequestOutput) -> OutputDelta:
        return cls(out.request_id, tuple(out.new_token_ids), out.new_text, len(out.token_ids),
                   out.finished, out.finish_reason, out.new_logprobs, out.prompt_logprobs)

    def merged(self, later: OutputDelta) -> OutputDelta:
        """This delta followed by ``later`` of the same request, as one."""
        if later.request_id != self.request_id or later.num_tokens != self.num_tokens + len(later.new_token_ids):
            raise ValueError(f"delta of {later.request_id} at {later.num_tokens} tokens does not "
                             f"follow {self.request_id} at {self.num_tokens}")
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return OutputDelta(self.request_id, self.new_token_ids + later.new_token_ids,
                           self.new_text + later.new_text, later.num_tokens, later.finished,
                           later.finish_reason, self.new_logprobs + later.new_logprobs, prompt,
                           self.cached_tokens or later.cached_tokens)


class Transcript:
    """The cumulative output of one request, rebuilt from its deltas (amortised O(1) each)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self._text: list[str] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def add(self, delta: OutputDelta) -> None:
        """Take the next delta (its ``num_tokens`` must follow on)."""
        if delta.num_tokens != len(self.token_ids) + len(delta.new_token_ids):
            raise ValueError(f"{delta.request_id}: a delta ending at {delta.num_tokens} tokens "
                             f"follows {len(self.token_ids)} (an output was lost)")
        self.token_ids.extend(delta.new_token_ids)
        self.logprobs.extend(delta.new_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.new_text:
            self._text.append(delta.new_text)
        self.finished, self.finish_reason = delta.finished, delta.finish_reason

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""


class Sequence:
    """Mutable engine-side state of one request.

    ``tokens`` holds prompt then generated tokens; ``num_computed`` of them have their KV in the
    cache. ``block_table`` lists the KV blocks in position order (owned by the block manager).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        params: SamplingParams,
        *,
        seed: int | None,
        stop_token_ids: frozenset[int],
        max_total_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = compact_tokens(prompt_token_ids)   # not copied if already one
        self.tokens = Tokens(self.prompt_token_ids)
        self.params = params
        # seeded draws are keyed by (seed, position) (engine/sampling.py); None: torch's global
        # generator. ``generator`` is the sampler's reusable torch.Generator.
        self.seed = seed
        self.generator: torch.Generator | None = None
        self.stop_token_ids = stop_token_ids
        self.max_total_tokens = max_total_tokens
        self.num_computed = 0
        self.block_table: list[int] = []
        # First position whose KV this engine holds: 0, except for the master of a request
        # whose earlier ranges sit on other decode instances (engine/elastic_rows.py); its
        # block table then starts at that position.
        self.kv_start = 0
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
        # Logprobs of sampled tokens not yet reported (``to_output`` hands them on), and of the
        # prompt: position 0 has none; filled chunk by chunk as the prefill computes them.
        self.pending_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None])
        self.prompt_logprobs_sent = False
        self.seen_prompt_ids: torch.Tensor | None = None   # engine/penalties.py, computed once

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens.generated[:]

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
        new_logprobs, self.pending_logprobs = tuple(self.pending_logprobs), []
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=tuple(self.output_token_ids),
            new_token_ids=new_token_ids,
            text=self.text,
            new_text=new_text,
            finished=self.is_finished,
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            new_logprobs=new_logprobs,
            prompt_logprobs=self._take_prompt_logprobs(),
        )

    def _take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        """The prompt's logprobs once all are computed, in one output only."""
        lp = self.prompt_logprobs
        if lp is None or self.prompt_logprobs_sent or len(lp) < self.num_prompt_tokens:
            return None
        self.prompt_logprobs_sent = True
        return tuple(lp)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, status={self.status.value})")
