"""The tokenizer a GGUF file describes, rebuilt with the ``tokenizers`` library.

Two vocabularies are found in Llama GGUF files (``tokenizer.ggml.model``):

    "gpt2"   byte-level BPE: ``tokens`` (byte-level strings) and ``merges`` ("a b", in rank
             order); how text is split before BPE is named by ``tokenizer.ggml.pre``
             (PRE_TOKENIZERS below: the llama.cpp names this loader knows)
    "llama"  SentencePiece BPE: ``tokens`` ("▁" for a space, "<0x41>" byte fallbacks) with
             ``scores``; a space is prefixed to every run of text unless
             ``tokenizer.ggml.add_space_prefix`` is false (llama.cpp does it after each special
             token too). The merges are not stored: a pair merges when the pair's concatenation
             is a token, higher-scored merged tokens first, which is SentencePiece's BPE order.

``token_type`` marks control tokens (3: split out of text whole, skipped when decoding) and
user-defined ones (4: split out whole, kept when decoding). BOS is added only where the file
asks for it (``tokenizer.ggml.add_bos_token``; when absent, llama.cpp's defaults: yes for
SentencePiece and the Llama-3 split, no for other byte-level BPE), so
``encode(text, add_bos=True)`` matches what the model was trained on. The chat template is
``tokenizer.chat_template``; decoding and chat rendering are HFTokenizer's.
"""

from __future__ import annotations

import numpy as np

from tetris.model.gguf_reader import GGUFFile
from tetris.model.tokenizer import HFTokenizer, TokenizerError

__all__ = ["GGUFTokenizer", "PRE_TOKENIZERS", "spm_merges"]

_CONTROL, _USER_DEFINED = 3, 4

# The Llama-3 split (llama.cpp "llama-bpe"): contractions, letter runs with one leading
# non-letter, digit runs of up to 3, punctuation runs, newlines, other whitespace.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split():
    from tokenizers import pre_tokenizers as pre

    return pre.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_split():
    # llama.cpp's "smollm": every digit alone, then the GPT-2 split.
    from tokenizers import pre_tokenizers as pre

    return pre.Sequence([pre.Digits(individual_digits=True),
                         pre.ByteLevel(add_prefix_space=False, use_regex=True)])


def _llama3_split():
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pre

    return pre.Sequence([pre.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                         pre.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> (pre-tokenizer factory, whether a word found whole in the vocabulary
# skips the merges, whether BOS is added when the file does not say), as llama.cpp has them.
PRE_TOKENIZERS = {
    "default": (_gpt2_split, False, False),
    "gpt2": (_gpt2_split, False, False),
    "smollm": (_smollm_split, False, False),
    "llama-bpe": (_llama3_split, True, True),
    "llama3": (_llama3_split, True, True),
    "smaug-bpe": (_llama3_split, False, False),
}


def _pre_type(gf: GGUFFile) -> tuple:
    pre = gf.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"{gf.path}: tokenizer.ggml.pre {pre!r} is not supported "
                             f"(supported: {', '.join(PRE_TOKENIZERS)})")
    return PRE_TOKENIZERS[pre]


def _byte_level_bpe(gf: GGUFFile, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models

    make_split, ignore_merges, _ = _pre_type(gf)
    merges = [tuple(m.split(" ", 1)) for m in gf.array("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = make_split()
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's greedy merging: every split of a token into two
    tokens, ordered by the merged token's score (highest first), then by the pieces' ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for merged, score in zip(tokens, scores.tolist(), strict=True):
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_bpe(gf: GGUFFile, tokens: list[str], types: np.ndarray):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = gf.array("tokenizer.ggml.scores", None)
    if scores is None:
        raise TokenizerError(f"{gf.path}: a 'llama' tokenizer needs tokenizer.ggml.scores")
    unk = gf.get("tokenizer.ggml.unknown_token_id", None)
    # Control tokens (BOS, EOS, ...) take part in no merge; they are split out whole.
    normal = [t if types[i] != _CONTROL else f"\0{i}" for i, t in enumerate(tokens)]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, spm_merges(normal, scores), byte_fallback=True,
                               fuse_unk=True, unk_token=None if unk is None else tokens[int(unk)]))
    space = [normalizers.Replace(" ", "\u2581")]
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gf.get("tokenizer.ggml.add_space_prefix", True):
        space.insert(0, normalizers.Prepend("\u2581"))
        steps.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(space)
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_specials(tok, tokens: list[str], types: np.ndarray) -> None:
    from tokenizers import AddedToken

    def added(i: int, special: bool):
        return AddedToken(tokens[i], special=special, normalized=False)

    tok.add_special_tokens([added(i, True) for i in np.flatnonzero(types == _CONTROL)])
    tok.add_tokens([added(i, False) for i in np.flatnonzero(types == _USER_DEFINED)])


class GGUFTokenizer(HFTokenizer):
    """The ``Tokenizer`` protocol over a GGUF file's vocabulary (see the module docstring)."""

    def __init__(self, gf: GGUFFile, *, bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = ()):
        kind = gf.get("tokenizer.ggml.model", None)
        tokens = gf.array("tokenizer.ggml.tokens")
        types = np.asarray(gf.array("tokenizer.ggml.token_type", np.ones(len(tokens))))
        if kind == "gpt2":
            self._tok = _byte_level_bpe(gf, tokens)
            bos_by_default = _pre_type(gf)[2]
        elif kind == "llama":
            self._tok = _sentencepiece_bpe(gf, tokens, types)
            bos_by_default = True
        else:
            raise TokenizerError(f"{gf.path}: tokenizer.ggml.model {kind!r} is not supported "
                                 "(supported: gpt2, llama)")
        _add_specials(self._tok, tokens, types)
        self.vocab_size = len(tokens)
        file_bos = gf.get("tokenizer.ggml.bos_token_id", None)
        self.bos_token_id = bos_token_id if bos_token_id is not None else (
            None if file_bos is None else int(file_bos))
        self.add_bos = bool(gf.get("tokenizer.ggml.add_bos_token", bos_by_default))
        eos = list(eos_token_ids)
        file_eos = gf.get("tokenizer.ggml.eos_token_id", None)
        if file_eos is not None and int(file_eos) not in eos:
            eos.append(int(file_eos))
        self.eos_token_ids = tuple(eos)
        self.chat_template = self._pick_template(gf.get("tokenizer.chat_template", None))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """``add_bos`` adds BOS where the file says the model takes one."""
        return super().encode(text, add_bos=add_bos and self.add_bos)
