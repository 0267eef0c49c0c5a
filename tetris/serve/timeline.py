"""Where one request's time went, on the dispatcher's clock: the TTFT breakdown."""

from __future__ import annotations

import msgspec

__all__ = ["RequestTimeline"]


class RequestTimeline(msgspec.Struct):
    """Where one request's time went (dispatcher clock, seconds); the TTFT breakdown."""

    request_id: str
    prompt_tokens: int
    arrival: float
    decode_instance: int = -1
    planned: float = 0.0          # plan committed
    prefill_start: float = 0.0    # first chunk started (prefill end minus its elapsed time)
    prefill_end: float = 0.0      # first token known
    turn_wait_s: float = 0.0      # of the prefill, waiting for later chunks' turns on their members
    first_token: float = 0.0      # the first token was yielded (0: not early, see first_token.py)
    first_output: float = 0.0     # the decode instance streamed its first output
    finished: float = 0.0
    chunks: int = 0
    sp_sizes: tuple[int, ...] = ()
    ttft_estimate: float = 0.0
    tokens: int = 0
    outcome: str = ""
    retries: int = 0              # runs again after a lost prefill worker or decode instance

    def breakdown(self) -> dict[str, float]:
        """queue (planning, and the first chunk's wait for its turn on its members), prefill
        (from the first chunk's start; ``turn_wait_s`` of it waiting for later chunks' turns),
        and hand-off (KV transfer tail + admission + first decode round); TTFT ends with the
        first token's yield, or with the first decode output."""
        return {"queue_s": self.prefill_start - self.arrival,
                "prefill_s": self.prefill_end - self.prefill_start,
                "turn_wait_s": self.turn_wait_s,
                "handoff_s": self.first_output - self.prefill_end,
                "ttft_s": (self.first_token or self.first_output) - self.arrival}
