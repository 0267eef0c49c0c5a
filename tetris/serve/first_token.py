"""The first token goes to the client when the prefill has it, not after the KV hand-off.

A request's TTFT ends with its prefill (SPEC §3: "the TTFT estimate of a plan is the finish
time of its last chunk"): the prefill member holding the prompt's last token samples the
first token. The decode instance still needs every layer of the KV and one round to admit the
request before its own stream starts, and that stream begins with the same first token
(``LLMEngine.commit_prefilled``). So the dispatcher streams the first token at once
(``FirstTokenStream.first``) and trims it from the decode outputs that follow
(``FirstTokenStream.follow``): the client sees each token and each character exactly once.

The first token's text comes from the same code the decode engine runs
(``tetris.engine.sampling.check_stop`` on a ``Sequence``), with the same hold-back of a
possible stop-string prefix and of an incomplete UTF-8 character. When that token would end
the request (a stop token, ``max_tokens`` 1, the context's end) nothing is sent early: the
decode instance's final output says how it ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from tetris.engine.request import OutputDelta, Sequence, TokenLogprob
from tetris.engine.sampling import check_stop
from tetris.serve.protocol import GenerateRequest

__all__ = ["EarlyFirstToken", "FirstTokenStream", "StreamCursor"]


class StreamCursor:
    """How much of one request's stream its client already has (``ids_sent`` output tokens,
    ``chars_sent`` characters), over a decode stream that starts again from its beginning:
    the stream after an early first token, or after a request was resumed on another
    instance. ``follow`` trims each output to what the client does not have yet."""

    def __init__(self, ids_sent: int, chars_sent: int) -> None:
        self._ids_sent = ids_sent
        self._chars_sent = chars_sent
        self._engine_chars = 0   # characters the decode engine has released so far

    @property
    def sent(self) -> tuple[int, int]:
        """(output tokens, characters) the client has so far."""
        return self._ids_sent, self._chars_sent

    def follow(self, out: OutputDelta) -> OutputDelta | None:
        """``out`` less what was already sent; None when nothing is left to say."""
        chars_before, ids_before = self._engine_chars, out.num_tokens - len(out.new_token_ids)
        self._engine_chars += len(out.new_text)
        new_text = out.new_text[max(0, self._chars_sent - chars_before):]
        self._chars_sent = max(self._chars_sent, self._engine_chars)
        cut = max(0, self._ids_sent - ids_before)
        new_ids = out.new_token_ids[cut:]
        self._ids_sent = max(self._ids_sent, out.num_tokens)
        if not new_ids and not new_text and not out.finished:
            return None
        # logprobs go with their tokens (one each, when the request asked for them)
        return msgspec.structs.replace(out, new_token_ids=tuple(new_ids), new_text=new_text,
                                       new_logprobs=out.new_logprobs[cut:])


class FirstTokenStream(StreamCursor):
    """One request's stream after its first token was sent: trims what the client has."""

    def __init__(self, first: OutputDelta) -> None:
        super().__init__(first.num_tokens, len(first.new_text))
        self.first = first


class EarlyFirstToken:
    """How a deployment's decode engines finish and detokenize, for the first token.

    ``decode`` maps token ids to text (None: the decode engines have no tokenizer, e.g.
    emulated ones, and outputs carry token ids only); ``eos_token_ids`` as the engines have
    them; ``max_model_len`` the context length.
    """

    def __init__(self, decode: Callable[[list[int]], str] | None, eos_token_ids: Iterable[int],
                 max_model_len: int) -> None:
        self.decode = decode
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len

    def open(self, req: GenerateRequest, first_token: int,
             logprob: TokenLogprob | None = None) -> FirstTokenStream | None:
        """The first token's output (with ``logprob`` when the request asked for logprobs);
        None when it is not to be sent early."""
        params = req.sampling
        if params.stop and self.decode is None:
            return None
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        # Only the output matters here, so the sequence starts empty and its length limit is
        # what the context leaves after the prompt.
        seq = Sequence(req.request_id, [], params, seed=None, stop_token_ids=stop_ids,
                       max_total_tokens=self.max_model_len - len(req.prompt_token_ids))
        seq.tokens.append(int(first_token))
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        if check_stop(seq, int(first_token), self.decode) is not None:
            return None
        return FirstTokenStream(OutputDelta.of(seq.to_output((int(first_token),))))
