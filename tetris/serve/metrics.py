"""Serving metrics in Prometheus text format, named like vLLM's under a ``tetris:`` prefix.

Each ``ServingMetrics`` owns its registry (no process-global state), so several apps or tests in
one process never clash. The dispatcher records request events; the ingress serves ``render()``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServingMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Long-context TTFTs reach tens of seconds; token gaps are milliseconds.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServingMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        self.ttft = hist("tetris:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("tetris:inter_token_latency_seconds", "Gap between streamed tokens.",
                        _TOKEN_GAP_BUCKETS)
        self.e2e = hist("tetris:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("tetris:request_queue_time_seconds",
                          "Time from arrival to the start of the request's first prefill chunk.")
        self.chunks = Histogram("tetris:prefill_chunks_per_request", "CDSP chunks per request.",
                                labels, registry=r, buckets=(1, 2, 3, 4, 5, 6, 8, 12, 16))
        self.sp_size = Histogram("tetris:prefill_chunk_sp_size", "SP size of each prefill chunk.",
                                 labels, registry=r, buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.prompt_tokens = Counter("tetris:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=r)
        self.generation_tokens = Counter("tetris:generation_tokens", "Tokens generated.", labels,
                                         registry=r)
        self.requests = Counter("tetris:request_success", "Finished requests by reason.",
                                labels + ["finished_reason"], registry=r)
        self.running = Gauge("tetris:num_requests_running", "Requests in prefill or decode.",
                             labels, registry=r)
        self.waiting = Gauge("tetris:num_requests_waiting", "Requests admitted but not started.",
                             labels, registry=r)
        self.kv_usage = Gauge("tetris:kv_cache_usage_perc", "Decode KV cache usage (0-1).",
                              labels + ["instance"], registry=r)
        self.improvement_rate = Gauge("tetris:improvement_rate",
                                      "Current CDSP improvement rate (theta).", labels, registry=r)
        self._model = model_name
        # Expose every series at zero from the start, so dashboards and rate() see them.
        for metric in (self.ttft, self.itl, self.e2e, self.queue, self.chunks, self.sp_size,
                       self.prompt_tokens, self.generation_tokens, self.running, self.waiting,
                       self.improvement_rate):
            metric.labels(model_name)

    def observe_plan(self, sp_sizes: list[int]) -> None:
        self.chunks.labels(self._model).observe(len(sp_sizes))
        for s in sp_sizes:
            self.sp_size.labels(self._model).observe(s)

    def observe_first_token(self, ttft_s: float, queue_s: float, prompt_tokens: int) -> None:
        self.ttft.labels(self._model).observe(ttft_s)
        self.queue.labels(self._model).observe(queue_s)
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)

    def observe_token_gap(self, gap_s: float) -> None:
        self.itl.labels(self._model).observe(gap_s)

    def observe_finish(self, e2e_s: float, generated: int, reason: str) -> None:
        self.e2e.labels(self._model).observe(e2e_s)
        self.generation_tokens.labels(self._model).inc(generated)
        self.requests.labels(self._model, reason).inc()

    def set_load(self, *, running: int, waiting: int) -> None:
        self.running.labels(self._model).set(running)
        self.waiting.labels(self._model).set(waiting)

    def set_kv_usage(self, instance: int, usage: float) -> None:
        self.kv_usage.labels(self._model, str(instance)).set(usage)

    def set_improvement_rate(self, theta: float) -> None:
        self.improvement_rate.labels(self._model).set(theta)

    def render(self) -> bytes:
        return generate_latest(self.registry)
