"""Tokenizers: a byte-level one for the dummy model, HF ``tokenizer.json`` for checkpoints.

Both expose the same surface (``Tokenizer``): ``encode(text, add_bos=True)``, ``decode(ids)``,
``bos_token_id``, ``eos_token_ids``, ``vocab_size`` and ``apply_chat_template(messages)``.
``decode`` skips special tokens unless asked to keep them (``skip_special_tokens=False``,
``spaces_between_special_tokens``: vLLM's request options).

Chat templates render *without* the BOS token: the caller encodes the prompt with
``add_bos=True``, so a request holds exactly one BOS whether it came as a chat or as text.
A checkpoint's own template (``chat_template`` in tokenizer_config.json) is rendered with
jinja2; without one, DEFAULT_CHAT_TEMPLATE (Llama-3 style) is used:

    <|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>     per message
    <|start_header_id|>assistant<|end_header_id|>\\n\\n                     generation prompt
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenizerError",
    "load_tokenizer",
    "render_default_chat",
    "BYTE_SPECIAL_TOKENS",
]

BYTE_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)


class TokenizerError(ValueError):
    """A tokenizer file is missing or invalid, or a chat request is malformed."""


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...


def _message_text(message: dict) -> tuple[str, str]:
    """(role, text) of an OpenAI-style message; content may be a string or text parts."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise TokenizerError(f"a chat message needs a string 'role', got {message!r}")
    content = message.get("content", "")
    if content is None:
        content = ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise TokenizerError(f"only text content parts are supported, got {part!r}")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise TokenizerError(f"message content must be text, got {type(content).__name__}")
    return message["role"], content


def render_default_chat(messages: list[dict]) -> str:
    """The Llama-3 style default template (see the module docstring); no BOS."""
    if not messages:
        raise TokenizerError("a chat request needs at least one message")
    parts = []
    for m in messages:
        role, text = _message_text(m)
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; the specials follow from 256; ids up to vocab_size - 1 are
    valid model outputs but decode to nothing (the dummy model may sample them)."""

    def __init__(self, vocab_size: int = 512):
        if vocab_size < 256 + len(BYTE_SPECIAL_TOKENS):
            raise TokenizerError(
                f"ByteTokenizer needs vocab_size >= {256 + len(BYTE_SPECIAL_TOKENS)}, got {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.special_ids = {tok: 256 + i for i, tok in enumerate(BYTE_SPECIAL_TOKENS)}
        self.bos_token_id = self.special_ids["<|begin_of_text|>"]
        self.eos_token_ids = (self.special_ids["<|end_of_text|>"], self.special_ids["<|eot_id|>"])
        self._split = re.compile("(" + "|".join(re.escape(t) for t in BYTE_SPECIAL_TOKENS) + ")")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_bos else []
        # Special-token strings in the text (rendered chat templates) become their ids.
        for piece in self._split.split(text):
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            data = bytes(i for i in ids if 0 <= i < 256)
            return data.decode("utf-8", errors="replace")
        names = {i: t for t, i in self.special_ids.items()}
        return join_special(ids, names, self.decode, spaces_between_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return render_default_chat(messages)


def join_special(ids: list[int], names: dict[int, str], decode, spaces: bool) -> str:
    """Text of ``ids`` with special tokens kept (by ``names``: id -> text): the runs of other
    tokens decode as usual; the pieces are joined by a space when ``spaces`` (vLLM's
    ``spaces_between_special_tokens``), else directly."""
    pieces, run = [], []
    for i in ids:
        if i in names:
            if run:
                pieces.append(decode(run))
                run = []
            pieces.append(names[i])
        else:
            run.append(i)
    if run:
        pieces.append(decode(run))
    return (" " if spaces else "").join(pieces)


def _token_string(value) -> str | None:
    # tokenizer_config.json stores specials as a string or as {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library, with ids from the checkpoint."""

    def __init__(self, path: str | Path, *, bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as _RustTokenizer

        p = Path(path)
        file = p / "tokenizer.json"
        if not file.exists():
            raise TokenizerError(f"{p}: no tokenizer.json")
        try:
            self._tok = _RustTokenizer.from_file(str(file))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise TokenizerError(f"{file}: cannot load: {e}") from None
        config = self._read_config(p / "tokenizer_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        bos_str = _token_string(config.get("bos_token"))
        eos_str = _token_string(config.get("eos_token"))
        self.bos_token_id = bos_token_id if bos_token_id is not None else (
            self._tok.token_to_id(bos_str) if bos_str else None)
        eos = list(eos_token_ids)
        eos_id = self._tok.token_to_id(eos_str) if eos_str else None
        if eos_id is not None and eos_id not in eos:
            eos.append(eos_id)
        self.eos_token_ids = tuple(eos)
        self.chat_template = self._pick_template(config.get("chat_template"))

    @staticmethod
    def _read_config(file: Path) -> dict:
        if not file.exists():
            return {}
        try:
            return json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{file}: not valid JSON: {e}") from None

    @staticmethod
    def _pick_template(value) -> str | None:
        # A list of named templates is allowed by HF; the "default" one serves chat.
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            return named.get("default")
        return value if isinstance(value, str) else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return self._tok.decode(list(ids), skip_special_tokens=True)
        names = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()
                 if t.special}
        return join_special(ids, names, self.decode, spaces_between_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.chat_template is None:
            return render_default_chat(messages)
        import jinja2
        import jinja2.sandbox

        for m in messages:
            _message_text(m)  # same validation as the default template
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise TokenizerError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, bos_token="", eos_token="",
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None


def load_tokenizer(path: str | Path, *, bos_token_id: int | None = None,
                   eos_token_ids: tuple[int, ...] = ()) -> HFTokenizer:
    return HFTokenizer(path, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids)
