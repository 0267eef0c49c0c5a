"""Token sampling and stop conditions.

Greedy rows take the argmax. Random rows apply temperature, then top-k, then top-p (nucleus:
the smallest set of most likely tokens whose probability reaches ``top_p``), then min-p (tokens
less likely than ``min_p`` times the most likely one are dropped), then draw. A request with
penalties or ``min_tokens`` has its row processed first (``engine/penalties.py``), greedy or
not. Every row is processed on its own, so a request's tokens for a given seed do not depend on
which other requests share its batch. A request that asks for ``logprobs`` gets them from the
raw row (``engine/logprobs.py``) in ``seq.pending_logprobs``.

A seeded draw is keyed by (seed, position): the token at position ``p`` of the sequence
(prompt and output counted together) is drawn from a generator seeded with
``position_seed(seed, p)``, not from a stream that advances with each draw. Whoever samples
that position draws the same: the prefill worker that samples the first output token, the
decode engine that samples the rest, the single-instance engine, and a request resumed on
another instance after a failure (``LLMEngine.reserve(..., generated)``). So a seed gives one
output whether the request ran locally or disaggregated, with or without a failure.

Logits may arrive in the model's own dtype (bf16/fp16) when every row of the batch is greedy
(``ModelRunner.execute``): widening to fp32 is exact and order-preserving, so the argmax,
ties included, is the same as on an fp32 copy, and the copy is skipped. Random rows are
widened to fp32 before any arithmetic (``process_logits``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import functools

import torch

from tetris.engine.logprobs import token_logprob
from tetris.engine.penalties import penalize
from tetris.engine.request import FinishReason, Sequence
from tetris.sampling_params import SamplingParams

__all__ = ["sample", "greedy_tokens", "process_logits", "check_stop", "position_seed", "draw",
           "text_decoder"]

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a request's draw at ``position``: SplitMix64's finalizer over both.

    Mixed so that neighbouring seeds and positions give unrelated draws (torch's CPU generator
    keeps only the low 32 bits of a seed, which a plain ``seed + position`` would leave
    correlated). Non-negative and below 2**63."""
    z = ((seed & _MASK64) ^ ((position + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def draw(probs: torch.Tensor, seed: int | None, position: int,
         generator: torch.Generator | None = None) -> int:
    """One token from ``probs`` [V]: keyed by (seed, position), or from torch's global
    generator when ``seed`` is None. ``generator`` is reused (reseeded) if given."""
    if seed is None:
        return int(torch.multinomial(probs, 1).item())
    gen = generator if generator is not None else torch.Generator(device="cpu")
    gen.manual_seed(position_seed(seed, position))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] float32 after temperature, top-k, top-p and min-p, for one random row.

    logits: [V]. Filtered tokens get probability exactly 0.
    """
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p, params.top_k)
    if params.min_p > 0.0:
        # relative to the most likely token, which top-k and top-p always keep
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


# Candidates looked at first for top-p: sorting a whole 128k vocabulary per row costs
# milliseconds, while the nucleus of a trained model is usually far smaller.
_TOP_P_CANDIDATES = 256


def _top_p(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``. probs: [V]."""
    vocab = probs.shape[-1]
    k = min(vocab, top_k if top_k > 0 else _TOP_P_CANDIDATES)
    vals, idx = torch.topk(probs, k)  # sorted, most likely first
    if k < vocab and top_k == 0 and float(vals.sum()) < top_p:
        vals, idx = torch.sort(probs, descending=True)  # the nucleus is wider: look at all
    # Keep a token if the mass strictly before it is below top_p: the most likely token
    # always survives, and the kept set is the smallest whose mass reaches top_p.
    keep = (torch.cumsum(vals, dim=-1) - vals) < top_p
    out = torch.zeros_like(probs)
    out[idx[keep]] = vals[keep]
    return out / out.sum()


# Widths tried for the blocks of ``greedy_tokens``, widest first: multiples of 256 keep the
# per-block max on whole vector registers. Measured at [32, 32000] bf16, 1 thread: 0.46 ms
# with 256-wide blocks against 1.0 ms for ``float().argmax`` (docs/benchmarks.md, decode).
_ARGMAX_BLOCKS = (2048, 1792, 1536, 1280, 1024, 768, 512, 256)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum, as ``logits.float().argmax(-1)`` gives it.

    logits [N, V] of any float dtype -> int64 [N]. torch's CPU argmax runs one element at a
    time (and bf16 ``argmax`` is 4x slower than fp32), while ``amax`` is vectorised. So each
    row is cut into blocks of ``c`` tokens: the first block whose max is the row's max holds
    the first maximal token (NaN counts as the largest value in both reductions, as in
    argmax), and only that block gets an argmax.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    width = next((c for c in _ARGMAX_BLOCKS if vocab % c == 0 and vocab > c), None)
    if width is None or n == 0 or logits.stride(-1) != 1:
        return logits.max(dim=-1).indices  # first maximal index, and no fp32 copy either
    blocks = logits.view(n, vocab // width, width)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [N]: first block holding the row max
    inner = blocks[torch.arange(n, device=logits.device), best].argmax(dim=-1)  # [N]
    return best * width + inner


def sample(logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
    """One token per row. logits: [N, V] (fp32, or any float dtype), row i belongs to seqs[i]."""
    if logits.shape[0] != len(seqs):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(seqs)} sequences")
    greedy: list[int] = []
    if any(seq.params.greedy and not seq.params.penalized for seq in seqs):
        greedy = greedy_tokens(logits).tolist()
    tokens = []
    for row, seq in enumerate(seqs):
        params = seq.params
        processed = penalize(logits[row], seq) if params.penalized else logits[row]
        if params.greedy:
            token = greedy[row] if not params.penalized else int(processed.argmax())
        else:
            if seq.generator is None and seq.seed is not None:
                seq.generator = torch.Generator(device="cpu")
            # the token drawn now takes position num_tokens
            token = draw(process_logits(processed, params), seq.seed, seq.num_tokens,
                         seq.generator)
        if params.logprobs is not None:
            seq.pending_logprobs.append(token_logprob(logits[row], token, params.logprobs))
        tokens.append(token)
    return tokens


def check_stop(seq: Sequence, token: int, decode) -> FinishReason | None:
    """Update ``seq.text`` for the appended ``token`` and say whether ``seq`` is done.

    ``decode`` maps token ids to text (``None`` when the engine has no tokenizer; it is called
    as ``text_decoder`` adapts it to the request). A stop token ends the request and stays out
    of the text; a stop string is cut from the text together with everything after it, as
    OpenAI does; with ``include_stop_str_in_output`` both stay in, only what follows is cut.
    Before ``min_tokens`` output tokens nothing but the length limit ends the request.
    """
    params = seq.params
    num_output = len(seq.tokens) - seq.num_prompt_tokens
    checking = num_output >= params.min_tokens
    hit_stop_token = checking and token in seq.stop_token_ids
    reason = None
    if hit_stop_token:
        reason = FinishReason.STOP
    elif num_output >= params.max_tokens or len(seq.tokens) >= seq.max_total_tokens:
        reason = FinishReason.LENGTH
    if decode is not None:
        ids = seq.output_token_ids
        prev_len = len(seq.text)
        drop_token = hit_stop_token and not params.include_stop_str_in_output
        append_text(seq, text_decoder(decode, params), ids[:-1] if drop_token else ids,
                    final=reason is not None)
        if params.stop and not hit_stop_token and checking:
            # Only a match that ends in the new text is new: search from where one could start.
            start = max(0, prev_len - max(len(s) for s in params.stop) + 1)
            cut = _first_stop(seq.text, params.stop, start, params.include_stop_str_in_output)
            if cut is not None:
                seq.text = seq.text[:cut]
                return FinishReason.STOP
    return reason


def text_decoder(decode, params: SamplingParams):
    """``decode`` as the request wants its text: special tokens skipped (the tokenizers'
    default) or kept, with or without spaces around them."""
    if params.skip_special_tokens:
        return decode
    return functools.partial(decode, skip_special_tokens=False,
                             spaces_between_special_tokens=params.spaces_between_special_tokens)


# Tokens of left context decoded with each new token: enough for tokenizers whose output for
# a token depends on its neighbours (SentencePiece's leading space, bytes of one character).
_DETOK_WINDOW = 6


def append_text(seq: Sequence, decode, ids: list[int], *, final: bool) -> None:
    """Extend ``seq.text`` with the text that ``ids[seq.detok_read:]`` adds.

    Decoding a short window and taking what the new tokens add to it keeps a step's cost flat
    (decoding all output ids every step grows with the output). Text that ends inside an
    incomplete UTF-8 character waits for the rest of its bytes, unless ``final``.
    """
    start, read = seq.detok_start, seq.detok_read
    if len(ids) <= read:
        return
    before = decode(ids[start:read]) if read > start else ""
    after = decode(ids[start:])
    if after.endswith("\ufffd") and not final:
        return
    seq.text += after[len(before):]
    seq.detok_read = len(ids)
    seq.detok_start = max(0, len(ids) - _DETOK_WINDOW)


def _first_stop(text: str, stops: tuple[str, ...], start: int, keep: bool) -> int | None:
    """Where ``text`` is cut: at the earliest stop string found from ``start`` (at its end when
    ``keep``; of two starting there, the first listed)."""
    found = [(i, k) for k, i in enumerate(text.find(s, start) for s in stops) if i >= 0]
    if not found:
        return None
    i, k = min(found)
    return i + len(stops[k]) if keep else i
