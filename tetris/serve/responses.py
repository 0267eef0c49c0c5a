"""OpenAI response bodies and stream chunks of one request's choices.

A request is one or more choices: ``n`` per prompt, prompt-major (choice ``p * n + j`` is the
j-th sample of prompt p, OpenAI's numbering), each generated as its own request. ``Choice``
holds what the API knows of one; ``ChoiceView`` turns its outputs into OpenAI choice objects,
whole (``full``) or chunk by chunk (``chunk``), with echo, logprobs and the per-choice usage
that ``stream_options.continuous_usage_stats`` puts in every chunk. ``usage`` sums a request:
each prompt's tokens once, every choice's output tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from tetris.engine.request import OutputDelta, Transcript
from tetris.serve.logprobs_format import CompletionLogprobs, TokenText, chat_logprobs
from tetris.serve.protocol import GenerateRequest

__all__ = ["Choice", "Prepared", "ChoiceView", "usage"]


class Choice:
    """One generation of a request: its index, its prompt's index and its engine request.
    ``prompt_text``: the text an echo returns (None without echo)."""

    __slots__ = ("index", "prompt_index", "gen", "prompt_text")

    def __init__(self, index: int, prompt_index: int, gen: GenerateRequest,
                 prompt_text: str | None) -> None:
        self.index, self.prompt_index, self.gen, self.prompt_text = (
            index, prompt_index, gen, prompt_text)


class Prepared:
    """A validated request, ready for the backend.

    ``logprobs``: None, or the top-N each token reports (completions) / chat's top_logprobs
    (``chat_logprobs`` true); ``prompt_only``: echo with ``max_tokens: 0`` (the one token
    generated is dropped).
    """

    def __init__(self, *, request_id: str, kind: str, created: int, choices: list[Choice],
                 prompt_tokens: Sequence[int], stream: bool, include_usage: bool,
                 continuous_usage: bool, logprobs: int | None, echo: bool,
                 prompt_only: bool) -> None:
        self.request_id, self.kind, self.created = request_id, kind, created
        self.choices, self.prompt_tokens = choices, list(prompt_tokens)
        self.stream, self.include_usage = stream, include_usage
        self.continuous_usage = continuous_usage
        self.logprobs, self.echo, self.prompt_only = logprobs, echo, prompt_only

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:   # as OpenAI and vLLM report a prefix-cache hit
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


class ChoiceView:
    """OpenAI choice objects of one ``Choice``."""

    def __init__(self, prepared: Prepared, choice: Choice, text_of: TokenText) -> None:
        self.p, self.c, self.text_of = prepared, choice, text_of
        self.started = False
        self.tokens = 0                 # output tokens reported so far
        self.cached_tokens = 0          # prompt tokens from a prefix cache (first output says)
        self.finish_reason: str | None = None
        self.completion_lp = CompletionLogprobs(text_of)

    @property
    def completion_tokens(self) -> int:
        return 0 if self.p.prompt_only else self.tokens

    @property
    def usage(self) -> dict:
        return usage(len(self.c.gen.prompt_token_ids), self.completion_tokens, self.cached_tokens)

    def note(self, out: OutputDelta) -> None:
        """Keep what an output says beside its tokens (a prefix-cache hit)."""
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)

    # -- pieces -----------------------------------------------------------------------------
    def _echo(self, prompt_logprobs) -> tuple[str, dict | None]:
        """The echoed prompt's text and (with logprobs) its logprobs block."""
        if not self.p.echo:
            return "", None
        block = None
        if self.p.logprobs is not None:
            if prompt_logprobs is None:
                raise RuntimeError(f"{self.c.gen.request_id}: echo with logprobs but the "
                                   "backend returned no prompt logprobs")
            block = self.completion_lp.block(self.c.gen.prompt_token_ids, prompt_logprobs)
        return self.c.prompt_text or "", block

    def _logprobs(self, token_ids, entries, prompt_block: dict | None):
        if self.p.logprobs is None:
            return None
        if len(entries) != len(token_ids):
            raise RuntimeError(f"{self.c.gen.request_id}: {len(entries)} logprob entries for "
                               f"{len(token_ids)} tokens (the backend dropped logprobs)")
        if self.p.chat:
            return chat_logprobs(entries, self.text_of)
        blocks = [] if prompt_block is None else [prompt_block]
        if not self.p.prompt_only:
            blocks.append(self.completion_lp.block(token_ids, entries))
        return CompletionLogprobs.join(blocks)

    def _choice(self, text: str, logprobs, finish: str | None, *, delta: bool) -> dict:
        if not self.p.chat:
            return {"index": self.c.index, "text": text, "logprobs": logprobs,
                    "finish_reason": finish}
        if delta:
            body = {"role": "assistant", "content": text} if not self.started else {"content": text}
            return {"index": self.c.index, "delta": body, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": self.c.index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish}

    # -- whole and streamed -----------------------------------------------------------------
    def full(self, out: Transcript) -> dict:
        self.tokens = len(out.token_ids)
        self.finish_reason = out.finish_reason
        echo_text, prompt_block = self._echo(out.prompt_logprobs)
        text = echo_text if self.p.prompt_only else echo_text + out.text
        logprobs = self._logprobs(out.token_ids, out.logprobs, prompt_block)
        return self._choice(text, logprobs, out.finish_reason, delta=False)

    def chunk(self, out: OutputDelta) -> dict | None:
        """The choice object of one streamed delta; None when it says nothing new."""
        first = not self.started
        self.tokens = out.num_tokens
        self.note(out)
        finish = out.finish_reason if out.finished else None
        if self.p.prompt_only:
            if not first:
                return None
            finish = "length"   # the prompt is the whole answer
        echo_text, prompt_block = self._echo(out.prompt_logprobs) if first else ("", None)
        text = echo_text + ("" if self.p.prompt_only else out.new_text)
        wants_logprobs = self.p.logprobs is not None and bool(out.new_token_ids)
        if not (first or text or finish or wants_logprobs):
            return None
        logprobs = self._logprobs(out.new_token_ids, out.new_logprobs, prompt_block)
        choice = self._choice(text, logprobs, finish, delta=True)
        self.started = True
        if finish:
            self.finish_reason = finish
        return choice
