"""Sampling parameters of one request, validated at construction.

Shared by the single-instance engine, the prefill workers (which sample the first token) and the
serving layer (which builds them from OpenAI requests). Invalid values raise ``ValueError`` with
the field name, so the HTTP layer can turn them into a 400.

Logits go through, in order (as vLLM does): ``min_tokens`` (stop tokens masked until that many
output tokens), ``repetition_penalty`` (prompt and output tokens), ``frequency_penalty`` and
``presence_penalty`` (output tokens), then temperature, ``top_k``, ``top_p``, ``min_p``.
``logprobs`` / ``prompt_logprobs`` are read off the raw logits, before any of that
(``tetris.engine.logprobs``).
"""

from __future__ import annotations

import msgspec

__all__ = ["SamplingParams", "MAX_LOGPROBS"]

# The most alternatives a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick tokens. ``temperature == 0`` is greedy; ``top_k == 0`` disables top-k.

    ``logprobs``: None, or report each output token's logprob and the ``logprobs`` most likely
    alternatives; ``prompt_logprobs`` likewise for every prompt token after the first.
    ``skip_special_tokens`` / ``spaces_between_special_tokens`` shape the detokenized text;
    ``include_stop_str_in_output`` keeps a matched stop string (or a stop token's text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._check_processing()
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")

    def _check_processing(self) -> None:
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 1e6:   # also refuses NaN
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits need the token history (penalties) or a mask (min_tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.min_tokens > 0)
