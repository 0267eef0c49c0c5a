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
    """``requests``: per-request latencies and counts (where the client is: the ingress);
    ``scheduler``: queue time, chunks, SP sizes, KV usage, θ (where they are decided: the
    dispatcher). A single-process server keeps both in one registry."""

    def __init__(self, model_name: str, *, requests: bool = True, scheduler: bool = True):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self._model = model_name

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        series = []
        self.ttft = self.itl = self.e2e = self.prompt_tokens = self.generation_tokens = None
        self.requests = self.running = self.waiting = None
        self.queue = self.chunks = self.sp_size = self.kv_usage = self.improvement_rate = None
        self.decode_up = self.decode_restarts = self.retries = None
        self.prefix_queries = self.prefix_hits = self.prefix_cached_tokens = None
        if requests:
            self.ttft = hist("tetris:time_to_first_token_seconds", "Time to first token.")
            self.itl = hist("tetris:inter_token_latency_seconds", "Gap between streamed tokens.",
                            _TOKEN_GAP_BUCKETS)
            self.e2e = hist("tetris:e2e_request_latency_seconds", "End-to-end request latency.")
            self.prompt_tokens = Counter("tetris:prompt_tokens", "Prompt tokens processed.",
                                         labels, registry=r)
            self.generation_tokens = Counter("tetris:generation_tokens", "Tokens generated.",
                                             labels, registry=r)
            self.requests = Counter("tetris:request_success", "Finished requests by reason.",
                                    labels + ["finished_reason"], registry=r)
            self.running = Gauge("tetris:num_requests_running", "Requests in prefill or decode.",
                                 labels, registry=r)
            self.waiting = Gauge("tetris:num_requests_waiting",
                                 "Requests admitted but not started.", labels, registry=r)
            series += [self.ttft, self.itl, self.e2e, self.prompt_tokens, self.generation_tokens,
                       self.running, self.waiting]
        if scheduler:
            self.queue = hist("tetris:request_queue_time_seconds",
                              "Time from arrival to the start of the request's first prefill chunk.")
            self.chunks = Histogram("tetris:prefill_chunks_per_request", "CDSP chunks per request.",
                                    labels, registry=r, buckets=(1, 2, 3, 4, 5, 6, 8, 12, 16))
            self.sp_size = Histogram("tetris:prefill_chunk_sp_size",
                                     "SP size of each prefill chunk.", labels, registry=r,
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128))
            self.kv_usage = Gauge("tetris:kv_cache_usage_perc", "Decode KV cache usage (0-1).",
                                  labels + ["instance"], registry=r)
            self.improvement_rate = Gauge("tetris:improvement_rate",
                                          "Current CDSP improvement rate (theta).", labels,
                                          registry=r)
            self.decode_up = Gauge("tetris:decode_instance_up",
                                   "1 while a decode instance is routed to, 0 while it is down "
                                   "(broken, restarting).", labels + ["instance"], registry=r)
            self.decode_restarts = Counter("tetris:decode_instance_restarts",
                                           "Restarts of broken decode instances.",
                                           labels + ["instance"], registry=r)
            self.retries = Counter("tetris:request_retries",
                                   "Requests run again after the prefill worker or decode instance "
                                   "serving them died, by the stage it died in.",
                                   labels + ["stage"], registry=r)
            # Prefix caching (docs/prefix_cache.md): plans that asked the index, those planned
            # from a cached prefix, and the prompt tokens they did not compute.
            self.prefix_queries = Counter("tetris:prefix_cache_queries",
                                          "Plans made with the prefix index.", labels, registry=r)
            self.prefix_hits = Counter("tetris:prefix_cache_hits",
                                       "Plans made from a cached prefix.", labels, registry=r)
            self.prefix_cached_tokens = Counter("tetris:prefix_cache_cached_tokens",
                                                "Prompt tokens taken from the prefix cache.",
                                                labels, registry=r)
            series += [self.queue, self.chunks, self.sp_size, self.improvement_rate]
        # Expose every series at zero from the start, so dashboards and rate() see them.
        for metric in series:
            metric.labels(model_name)

    def observe_plan(self, sp_sizes: list[int]) -> None:
        if self.chunks is None:
            return
        self.chunks.labels(self._model).observe(len(sp_sizes))
        for s in sp_sizes:
            self.sp_size.labels(self._model).observe(s)

    def observe_queue(self, queue_s: float) -> None:
        if self.queue is not None:
            self.queue.labels(self._model).observe(queue_s)

    def observe_first_token(self, ttft_s: float, queue_s: float | None, prompt_tokens: int) -> None:
        """``queue_s`` None: the queue time is recorded where it is known (the dispatcher)."""
        if queue_s is not None:
            self.observe_queue(queue_s)
        if self.ttft is not None:
            self.ttft.labels(self._model).observe(ttft_s)
            self.prompt_tokens.labels(self._model).inc(prompt_tokens)

    def observe_token_gap(self, gap_s: float) -> None:
        if self.itl is not None:
            self.itl.labels(self._model).observe(gap_s)

    def observe_finish(self, e2e_s: float, generated: int, reason: str) -> None:
        if self.e2e is None:
            return
        self.e2e.labels(self._model).observe(e2e_s)
        self.generation_tokens.labels(self._model).inc(generated)
        self.requests.labels(self._model, reason).inc()

    def set_load(self, *, running: int, waiting: int) -> None:
        if self.running is not None:
            self.running.labels(self._model).set(running)
            self.waiting.labels(self._model).set(waiting)

    def set_kv_usage(self, instance: int, usage: float) -> None:
        if self.kv_usage is not None:
            self.kv_usage.labels(self._model, str(instance)).set(usage)

    def set_decode_up(self, instance: int, up: bool) -> None:
        if self.decode_up is not None:
            self.decode_up.labels(self._model, str(instance)).set(1.0 if up else 0.0)

    def count_decode_restart(self, instance: int) -> None:
        if self.decode_restarts is not None:
            self.decode_restarts.labels(self._model, str(instance)).inc()

    def count_retry(self, stage: str) -> None:
        if self.retries is not None:
            self.retries.labels(self._model, stage).inc()

    def count_prefix_query(self, cached_tokens: int) -> None:
        if self.prefix_queries is not None:
            self.prefix_queries.labels(self._model).inc()
            if cached_tokens:
                self.prefix_hits.labels(self._model).inc()
                self.prefix_cached_tokens.labels(self._model).inc(cached_tokens)

    def set_improvement_rate(self, theta: float) -> None:
        if self.improvement_rate is not None:
            self.improvement_rate.labels(self._model).set(theta)

    def render(self) -> bytes:
        return generate_latest(self.registry)
