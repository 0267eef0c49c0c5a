"""Locust load test of an OpenAI-compatible Tetris endpoint (streaming completions).

Two user classes; name one on the command line:

- ``OpenLoopUser`` (run with ``-u 1``): open-loop arrivals, either a seeded Poisson process at
  ``--tetris-rate`` over a Short/Medium/Long length distribution, or a trace file replayed at its
  own timestamps (``--tetris-trace``; rescaled to ``--tetris-rate`` when given). Each request is
  sent on its own greenlet at its arrival time, so a slow server never slows the arrivals.
- ``ClosedLoopUser`` (run with ``-u N``): fixed concurrency, each user sends its next request as
  soon as the last one finished.

Prompts are sent as token-id lists, so every request has exactly the prompt length the workload
asks for. TTFT, inter-token latency and end-to-end latency are reported as Locust entries
(``TTFT``, ``ITL``, ``E2E``) and written with P50/P90/P99 and SLO attainment to
``PREFIX_summary.json`` and ``PREFIX_requests.csv``. Runs are bounded by ``--tetris-requests``
(and Locust's ``-t``) and, unless ``--tetris-allow-remote`` is given, target loopback only.

    locust -f loadtest/locustfile.py --headless -u 1 -r 1 -t 120s --host http://127.0.0.1:8000 \\
        OpenLoopUser --tetris-workload short --tetris-rate 2 --tetris-requests 50 \\
        --tetris-length-scale 0.01 --tetris-summary results/short
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import gevent
import numpy as np
from locust import HttpUser, constant, events, task
from urllib3 import PoolManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import LoadReport, RequestRecord  # noqa: E402

from tetris.sim.workload import OUTPUT_LENGTHS, load_trace, poisson_workload, scale_to_rate, workload_by_name  # noqa: E402

_REPORT: LoadReport | None = None
_STARTED = time.monotonic()
_QUITTING = False


def _quit_once(environment) -> None:
    """Stop the run exactly once, from its own greenlet: a user greenlet that calls quit() is
    itself among those quit() kills, and several users finishing together would race."""
    global _QUITTING
    if not _QUITTING:
        _QUITTING = True
        gevent.spawn(environment.runner.quit)


@events.init_command_line_parser.add_listener
def _add_options(parser):
    g = parser.add_argument_group("tetris")
    g.add_argument("--tetris-workload", default="short", help="short|medium|long")
    g.add_argument("--tetris-trace", default="", help="CSV/JSONL trace (arrival_time, prompt_tokens, output_tokens)")
    g.add_argument("--tetris-rate", type=float, default=1.0, help="arrival rate in req/s (open loop)")
    g.add_argument("--tetris-requests", type=int, default=50, help="requests to send in all")
    g.add_argument("--tetris-length-scale", type=float, default=1.0,
                   help="multiply prompt lengths (e.g. 0.01 for the tiny CPU model)")
    g.add_argument("--tetris-max-prompt-tokens", type=int, default=0, help="clamp prompt lengths (0: none)")
    g.add_argument("--tetris-output-tokens", type=int, default=0, help="fixed output length (0: from the workload)")
    g.add_argument("--tetris-model", default="", help="model name (default: first of /v1/models)")
    g.add_argument("--tetris-seed", type=int, default=0)
    g.add_argument("--tetris-slo-ttft", type=float, default=None, help="TTFT SLO in seconds")
    g.add_argument("--tetris-slo-itl", type=float, default=None, help="mean inter-token SLO in seconds")
    g.add_argument("--tetris-summary", default="loadtest-results/run", help="output prefix")
    g.add_argument("--tetris-request-timeout", type=float, default=600.0)
    g.add_argument("--tetris-allow-remote", action="store_true", help="allow a non-loopback --host")


@events.test_start.add_listener
def _on_start(environment, **_):
    global _REPORT, _STARTED, _QUITTING
    opts = environment.parsed_options
    _check_host(environment.host or "", opts.tetris_allow_remote)
    _REPORT = LoadReport(slo_ttft_s=opts.tetris_slo_ttft, slo_itl_s=opts.tetris_slo_itl)
    _STARTED = time.monotonic()
    _QUITTING = False


@events.test_stop.add_listener
def _on_stop(environment, **_):
    if _REPORT is None:
        return
    summary = _REPORT.write(environment.parsed_options.tetris_summary, time.monotonic() - _STARTED)
    print("tetris load test summary: " + json.dumps(summary), flush=True)


def _check_host(host: str, allow_remote: bool) -> None:
    name = urlparse(host).hostname or ""
    if allow_remote:
        return
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(name, None)}
    except socket.gaierror:
        addrs = set()
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise SystemExit(f"--host {host!r} is not a loopback address; pass --tetris-allow-remote "
                         "to load-test another machine")


def build_workload(opts) -> list[tuple[float, int, int]]:
    """(arrival offset s, prompt tokens, output tokens) for every request, seeded."""
    if opts.tetris_trace:
        reqs = load_trace(opts.tetris_trace)[: opts.tetris_requests]
        if opts.tetris_rate and len(reqs) > 1:
            reqs = scale_to_rate(reqs, opts.tetris_rate)
    else:
        reqs = poisson_workload(workload_by_name(opts.tetris_workload), opts.tetris_rate,
                                opts.tetris_requests, opts.tetris_seed, OUTPUT_LENGTHS)
    out = []
    for r in reqs:
        p = max(1, int(round(r.prompt_tokens * opts.tetris_length_scale)))
        if opts.tetris_max_prompt_tokens:
            p = min(p, opts.tetris_max_prompt_tokens)
        o = opts.tetris_output_tokens or r.output_tokens
        out.append((r.arrival_time, p, o))
    return out


class _TetrisUser(HttpUser):
    abstract = True
    pool_manager = PoolManager(maxsize=512, block=False)

    def on_start(self):
        opts = self.environment.parsed_options
        self.opts = opts
        self.model = opts.tetris_model or self._first_model()
        self.rng = np.random.default_rng(opts.tetris_seed + 1)

    def _first_model(self) -> str:
        r = self.client.get("/v1/models", name="/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def send(self, request_id: str, prompt_tokens: int, output_tokens: int) -> None:
        # Byte-range ids are valid in every vocabulary we serve and never special tokens.
        prompt = self.rng.integers(0, 256, size=prompt_tokens).tolist()
        body = {"model": self.model, "prompt": prompt, "max_tokens": output_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        rec = RequestRecord(request_id, prompt_tokens, time.monotonic())
        try:
            self._stream(body, rec)
        except Exception as e:  # noqa: BLE001 - every failure is a failed request, never a crash
            rec.ok, rec.error = False, f"{type(e).__name__}: {e}"
        _REPORT.add(rec)
        self._fire("E2E", rec.e2e_s if rec.ok else 0.0, None if rec.ok else rec.error)

    def _stream(self, body: dict, rec: RequestRecord) -> None:
        t0 = rec.sent_at
        last = None
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              name="/v1/completions", timeout=self.opts.tetris_request_timeout) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                raise RuntimeError(f"HTTP {resp.status_code}")
            # chunk_size=None yields each HTTP chunk as it arrives (no read-ahead bunching).
            for line in resp.iter_lines(chunk_size=None):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.monotonic()
                if last is None:
                    rec.ttft_s = now - t0
                    self._fire("TTFT", rec.ttft_s)
                else:
                    rec.token_gaps_s.append(now - last)
                    self._fire("ITL", now - last)
                last = now
                rec.output_tokens += 1
            resp.success()
        rec.e2e_s = time.monotonic() - t0
        rec.ok = last is not None

    def _fire(self, kind: str, seconds: float, error: str | None = None) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=kind.lower(), response_time=seconds * 1000.0,
            response_length=0, exception=RuntimeError(error) if error else None, context={})


class OpenLoopUser(_TetrisUser):
    """One user that replays the whole arrival schedule; requests run concurrently."""

    fixed_count = 1
    wait_time = constant(0)

    @task
    def replay(self):
        start = time.monotonic()
        greenlets = []
        for i, (t, p, o) in enumerate(build_workload(self.opts)):
            gevent.sleep(max(0.0, start + t - time.monotonic()))
            greenlets.append(gevent.spawn(self.send, f"r{i}", p, o))
        gevent.joinall(greenlets, timeout=self.opts.tetris_request_timeout)
        _quit_once(self.environment)
        gevent.sleep(3600)  # wait to be stopped; the run is over


class ClosedLoopUser(_TetrisUser):
    """Fixed concurrency: ``-u N`` users, each sends its next request when the last finishes."""

    wait_time = constant(0)
    _queue: list[tuple[float, int, int]] | None = None
    _next = 0

    @task
    def one(self):
        cls = ClosedLoopUser
        if cls._queue is None:
            cls._queue = build_workload(self.opts)
        if cls._next >= len(cls._queue):
            if _REPORT is not None and len(_REPORT.records) >= len(cls._queue):
                _quit_once(self.environment)
            gevent.sleep(0.05)
            return
        i = cls._next
        cls._next += 1
        _, p, o = cls._queue[i]
        self.send(f"r{i}", p, o)
