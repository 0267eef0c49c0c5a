"""Tiny stand-ins used by the simulator tests: a linear latency model, a least-queue SP-k
policy and a most-free-slots router. They follow the scheduler contract's signatures."""

from __future__ import annotations

from tetris.plan import Chunk, PrefillPlan


class LinearLatency:
    """T_s(h, l) = (0.01 + l / 1e4) / s seconds."""

    sp_sizes = (1, 2, 4)

    def predict(self, sp: int, history_tokens: int, chunk_tokens: int) -> float:
        return (0.01 + chunk_tokens / 1e4) / sp


class LeastQueuePolicy:
    """One chunk on the ``sp`` instances with the shortest queues (lowest index on ties)."""

    def __init__(self, latency, sp: int = 1):
        self.name = f"least-queue-{sp}"
        self.latency, self.sp = latency, sp

    def plan(self, request_id, prompt_tokens, now, pool, improvement_rate=None):
        order = sorted(range(len(pool.queue_times)), key=lambda i: (pool.queue_times[i], i))
        group = tuple(order[: self.sp])
        start = max([now] + [pool.queue_times[i] for i in group])
        end = start + self.latency.predict(self.sp, 0, prompt_tokens)
        return PrefillPlan(request_id, prompt_tokens, (Chunk(0, prompt_tokens, group, start, end),),
                           ttft_estimate=end - now, policy=self.name)


class MostFreeRouter:
    def __init__(self, n: int):
        self.free = [10**9] * n
        self.virtual = [0] * n
        self.calls: list[tuple] = []

    def choose(self, kv_tokens: int, avoid=frozenset()) -> int:
        return max(range(len(self.free)), key=lambda d: (self.free[d] - self.virtual[d], -d))

    def reserve(self, d: int, kv_tokens: int) -> None:
        self.virtual[d] += kv_tokens

    def release(self, d: int, kv_tokens: int) -> None:
        self.virtual[d] -= kv_tokens

    def update(self, d: int, free_slots: int, batch_size: int) -> None:
        self.free[d] = free_slots
        self.calls.append((d, free_slots, batch_size))
