"""Logit processing that needs a request's token history: penalties and ``min_tokens``.

Applied to one row of raw logits before temperature and the top-k/top-p/min-p filters, in
vLLM's order and with its (and OpenAI's) definitions:

1. ``min_tokens``: until the request has that many output tokens, its stop tokens (EOS unless
   ``ignore_eos``, and ``stop_token_ids``) get -inf, so it cannot end early;
2. ``repetition_penalty`` r (CTRL, Keskar et al. 2019; HF's definition): every token seen in
   the prompt or the output has its logit divided by r when positive, multiplied by r when not;
3. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI): a token that occurs c times in
   the output loses ``f * c + p * (c > 0)``.

Greedy requests get the same processing (the argmax of the processed row), as in vLLM.
"""

from __future__ import annotations

import torch

from tetris.engine.request import Sequence

__all__ = ["penalize"]


def penalize(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """logits [V] (raw) -> a float32 copy with ``seq``'s penalties and ``min_tokens`` mask."""
    params = seq.params
    out = logits.float().clone()
    vocab = out.shape[-1]
    generated = seq.tokens.generated
    if len(generated) < params.min_tokens:
        stops = [t for t in sorted(seq.stop_token_ids) if t < vocab]
        if stops:
            out[torch.tensor(stops, dtype=torch.int64, device=out.device)] = float("-inf")
    output = torch.tensor(generated, dtype=torch.int64, device=out.device)
    if params.repetition_penalty != 1.0:
        seen = torch.unique(torch.cat([_prompt_ids(seq).to(out.device), output]))
        vals = out[seen]
        r = params.repetition_penalty
        out[seen] = torch.where(vals > 0, vals / r, vals * r)
    if generated and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return out


def _prompt_ids(seq: Sequence) -> torch.Tensor:
    """The prompt's distinct token ids (int64), computed once per request: a long prompt is
    not re-read at every step."""
    if seq.seen_prompt_ids is None:
        prompt = torch.frombuffer(seq.prompt_token_ids, dtype=torch.int32) \
            if len(seq.prompt_token_ids) else torch.empty(0, dtype=torch.int32)
        seq.seen_prompt_ids = torch.unique(prompt.to(torch.int64))
    return seq.seen_prompt_ids
