"""One request as the dispatcher follows it: where its time went (the TTFT breakdown), what
its client already has, and the ids of its runs."""

from __future__ import annotations

import msgspec

__all__ = ["RequestTimeline", "ClientProgress", "attempt_id"]

_RETRY = "#retry"   # a run of a request after a lost instance: "<id>#retry<n>"


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


def attempt_id(request_id: str, retries: int) -> str:
    """The id the pools know run ``retries`` of a request by: the request's own id for the first
    run, a fresh one for each run again (a lost instance may still hold the earlier run)."""
    return request_id if not retries else f"{request_id}{_RETRY}{retries}"


class ClientProgress:
    """What the client of one request already has, and where its current run is."""

    __slots__ = ("token_ids", "chars", "stage", "lost_decode", "outdated")

    def __init__(self) -> None:
        self.token_ids: list[int] = []         # output tokens yielded so far
        self.chars = 0                         # characters of text yielded so far
        self.stage = "routing"
        self.lost_decode: int | None = None    # the decode instance the last run lost
        self.outdated = 0                      # runs again for outdated plans (not charged)
