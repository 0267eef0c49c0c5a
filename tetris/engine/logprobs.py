"""Log-probabilities of sampled and prompt tokens, read off the raw logits.

Raw means before any processing: log-softmax of the model's logits, not of the logits after
penalties, temperature, top-k/top-p or min-p. This is vLLM's default (``logprobs_mode =
"raw_logprobs"``) and what evaluation harnesses expect: a loglikelihood must not depend on the
sampling settings of the request that measured it. A greedy request's token is therefore always
the top-1 of its logprobs (without penalties), and a sampled one may be any token of the
vocabulary, its logprob included.

Prompt logprobs cost a full-vocabulary projection per prompt position (the engine otherwise
projects only the last one), so they are computed only when a request asks
(``SamplingParams.prompt_logprobs``), in blocks of ``PROMPT_ROWS`` positions to bound memory.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tetris.engine.request import Sequence, TokenLogprob

__all__ = ["token_logprob", "logprobs_of_rows", "record_prompt_logprobs", "PROMPT_ROWS"]

# Prompt positions projected to the vocabulary at once (256 x 128k fp32 = 128 MiB).
PROMPT_ROWS = 256


def logprobs_of_rows(logits: torch.Tensor, tokens: Seq[int], n: int) -> list[TokenLogprob]:
    """logits [R, V] (any float dtype), tokens [R] -> one ``TokenLogprob`` per row: the logprob
    of ``tokens[r]`` and the ``n`` most likely tokens of row r."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.as_tensor(list(tokens), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, target[:, None])[:, 0].tolist()
    if n > 0:
        vals, idx = torch.topk(lp, min(n, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(int(t), float(c), top) for t, c, top in zip(tokens, chosen, tops)]


def token_logprob(logits: torch.Tensor, token: int, n: int) -> TokenLogprob:
    """logits [V] -> the logprob of ``token`` and the ``n`` most likely tokens."""
    return logprobs_of_rows(logits[None], [token], n)[0]


def record_prompt_logprobs(model, hidden: torch.Tensor, row: int, start: int, n: int,
                           seq: Sequence) -> None:
    """Extend ``seq.prompt_logprobs`` with what a prefill chunk computed.

    hidden [T, H]: the batch's final-normed hidden states; rows [row, row + n) are the chunk,
    at positions [start, start + n) of ``seq``. Position p's logits give the logprob of prompt
    token p + 1; positions already recorded (a recompute after preemption) and the last
    prompt position (its logits sample the first output token) are skipped.
    """
    recorded = seq.prompt_logprobs
    if recorded is None:
        return
    first = max(start, len(recorded) - 1)             # first position whose next is missing
    last = min(start + n, seq.num_prompt_tokens - 1)  # exclusive
    k = seq.params.prompt_logprobs or 0
    for p0 in range(first, last, PROMPT_ROWS):
        p1 = min(p0 + PROMPT_ROWS, last)
        rows = hidden[row + p0 - start: row + p1 - start]
        targets = seq.tokens[p0 + 1: p1 + 1]
        recorded.extend(logprobs_of_rows(model.logits(rows), targets, k))
