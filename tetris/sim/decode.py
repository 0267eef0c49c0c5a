"""Decode instances with iteration-level (continuous) batching (SPEC §5).

A request enters its instance's waiting queue when its KV has arrived. At every iteration
boundary the instance admits waiting requests in FIFO order while the batch has room and the
KV capacity holds the request's prompt plus its whole output (reserving the final size up front
means no request is ever preempted; a simplification of paged allocation). One iteration
produces one token for every running request and lasts ``step_time(tp, batch, context)``.

The first output token comes from prefill; the decode instance produces the remaining
``output_tokens - 1``. TBT samples: every iteration contributes its duration once per running
request, plus each request's gap between its first token (end of prefill) and its second.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable

__all__ = ["DecodeInstanceSim", "DecodeRequest"]


class DecodeRequest:
    __slots__ = ("request_id", "kv_tokens", "remaining", "first_token_time", "ready_time",
                 "second_token_time", "finish_time", "index")

    def __init__(self, request_id: str, index: int, prompt_tokens: int, output_tokens: int,
                 first_token_time: float) -> None:
        self.request_id = request_id
        self.index = index
        self.kv_tokens = prompt_tokens + output_tokens
        self.remaining = output_tokens - 1
        self.first_token_time = first_token_time
        self.ready_time = first_token_time
        self.second_token_time = float("nan")
        self.finish_time = first_token_time if output_tokens <= 1 else float("nan")


class DecodeInstanceSim:
    """One decode instance; the simulator drives it with ``start_step``/``finish_step``."""

    def __init__(self, index: int, tp_size: int, kv_capacity_tokens: int, max_batch_size: int,
                 step_time: Callable[[int, int, int], float]) -> None:
        if kv_capacity_tokens <= 0 or max_batch_size <= 0:
            raise ValueError("decode KV capacity and batch size must be positive")
        self.index = index
        self.tp_size = tp_size
        self.capacity = kv_capacity_tokens
        self.max_batch = max_batch_size
        self.step_time = step_time
        self.waiting: deque[DecodeRequest] = deque()
        self.running: list[tuple[int, int, DecodeRequest]] = []  # heap of (finish_step, seq, req)
        self.used_tokens = 0          # reserved KV of running requests
        self.context_tokens = 0       # KV tokens the next iteration attends to
        self.steps = 0
        self.stepping = False
        self.available_at = 0.0       # LoongServe: an instance may still owe prefill work
        self.busy_s = 0.0
        self.step_durations: list[float] = []
        self.step_batches: list[int] = []
        self._seq = 0

    @property
    def batch_size(self) -> int:
        return len(self.running)

    @property
    def free_tokens(self) -> int:
        return self.capacity - self.used_tokens

    def can_admit(self, req: DecodeRequest) -> bool:
        return len(self.running) < self.max_batch and req.kv_tokens <= self.free_tokens

    def can_hold(self, kv_tokens: int) -> bool:
        """Whether a request of ``kv_tokens`` (prompt + output) could ever run here: one that
        cannot is refused at arrival (``Simulation``), as the live decode instance's
        reservation refuses it (DecodeFull, a 429), and never enqueued."""
        return kv_tokens <= self.capacity

    def enqueue(self, req: DecodeRequest) -> None:
        if not self.can_hold(req.kv_tokens):
            raise ValueError(f"request {req.request_id} needs {req.kv_tokens} KV tokens; decode "
                             f"instance {self.index} holds {self.capacity}")
        self.waiting.append(req)

    def _admit(self) -> list[DecodeRequest]:
        admitted = []
        while self.waiting and self.can_admit(self.waiting[0]):
            req = self.waiting.popleft()
            if req.remaining <= 0:
                continue
            self.used_tokens += req.kv_tokens
            self.context_tokens += req.kv_tokens - req.remaining  # prompt + first token
            heapq.heappush(self.running, (self.steps + req.remaining, self._seq, req))
            self._seq += 1
            admitted.append(req)
        return admitted

    def start_step(self, now: float) -> float | None:
        """Admit waiting requests and start an iteration; returns its end time, or None if idle."""
        admitted = self._admit()
        if not self.running:
            self.stepping = False
            return None
        dur = self.step_duration()
        self.stepping = True
        self.step_durations.append(dur)
        self.step_batches.append(len(self.running))
        self.busy_s += dur
        for req in admitted:
            req.second_token_time = now + dur
        return now + dur

    def step_duration(self) -> float:
        """How long the iteration starting now takes (its batch over its context)."""
        return self.step_time(self.tp_size, len(self.running), self.context_tokens)

    def finish_step(self, now: float) -> list[DecodeRequest]:
        """Account one iteration ending at ``now``; returns the requests that finished."""
        self.steps += 1
        self.context_tokens += len(self.running)
        done = []
        while self.running and self.running[0][0] <= self.steps:
            _, _, req = heapq.heappop(self.running)
            req.finish_time = now
            self.used_tokens -= req.kv_tokens
            self.context_tokens -= req.kv_tokens
            done.append(req)
        self.stepping = False
        return done
