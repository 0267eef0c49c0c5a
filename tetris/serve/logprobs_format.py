"""Logprobs in OpenAI's two wire formats, from the engine's ``TokenLogprob`` entries.

- Completions (the legacy format; lm-evaluation-harness reads it): ``{"tokens": [...],
  "token_logprobs": [...], "top_logprobs": [{token: logprob, ...}, ...], "text_offset": [...]}``.
  ``top_logprobs`` holds the N most likely tokens and, as OpenAI documents, always the chosen
  one (so up to N + 1 entries). The first prompt token of an echo has ``null`` for both.
- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...]}`` with exactly the N most likely tokens.

A token's text is its own decoding, special tokens by name (``TokenText``); ``bytes`` are that
text's UTF-8 bytes (a byte-level token that is part of a character reads as U+FFFD, as in
vLLM). Logprobs are clamped at -9999.0 (JSON has no -Infinity), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

from tetris.engine.request import TokenLogprob

__all__ = ["TokenText", "CompletionLogprobs", "chat_logprobs"]

_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return max(float(logprob), _FLOOR)


class TokenText:
    """Token id -> text for logprobs, cached (a tokenizer's decode is not free)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except TypeError:   # a tokenizer without the option: specials decode to ""
                text = self.tokenizer.decode([token_id])
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = text
        return text


class CompletionLogprobs:
    """Builds the legacy ``logprobs`` objects of one choice, piece by piece (a streamed choice
    gets one per chunk); ``text_offset`` runs on from ``offset``."""

    def __init__(self, text_of: TokenText, offset: int = 0) -> None:
        self.text_of = text_of
        self.offset = offset

    def block(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
        """``entries[i]`` for ``token_ids[i]`` (None: no logprob, the first prompt token)."""
        if len(token_ids) != len(entries):
            raise ValueError(f"{len(entries)} logprob entries for {len(token_ids)} tokens")
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token, entry in zip(token_ids, entries):
            text = self.text_of(int(token))
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_clamp(entry.logprob))
            top: dict[str, float] = {}
            for t, lp in entry.top:
                top.setdefault(self.text_of(t), _clamp(lp))
            top.setdefault(text, _clamp(entry.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    @staticmethod
    def join(blocks: Sequence[dict]) -> dict:
        """Several blocks as one (an echo's prompt, then its output)."""
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {k: [x for b in blocks for x in b[k]] for k in keys}


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], text_of: TokenText) -> dict:
    """The chat ``logprobs`` object of some output tokens."""
    content = []
    for e in entries:
        item = _chat_entry(text_of(e.token_id), e.logprob)
        item["top_logprobs"] = [_chat_entry(text_of(t), lp) for t, lp in e.top]
        content.append(item)
    return {"content": content}
