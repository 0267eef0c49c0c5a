"""Load-test measurement: statistics, and a real headless Locust run against a fake SSE server
whose first-token delay and token gap are known, so the measured TTFT and ITL can be checked."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "loadtest"))
from report import LoadReport, RequestRecord, percentile  # noqa: E402

FIRST_TOKEN_DELAY = 0.15
TOKEN_GAP = 0.03


def test_percentile_matches_numpy_linear_interpolation():
    xs = list(np.random.default_rng(0).exponential(size=37))
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def test_summary_counts_failures_and_slo_attainment(tmp_path):
    rep = LoadReport(slo_ttft_s=1.0)
    rep.add(RequestRecord("a", 10, 0.0, ok=True, ttft_s=0.5, e2e_s=1.0, output_tokens=3, token_gaps_s=[0.1, 0.2]))
    rep.add(RequestRecord("b", 10, 0.0, ok=True, ttft_s=2.0, e2e_s=3.0, output_tokens=2, token_gaps_s=[0.3]))
    rep.add(RequestRecord("c", 10, 0.0, ok=False, error="HTTP 503"))
    s = rep.write(tmp_path / "run", duration_s=10.0)
    assert (s["requests"], s["succeeded"], s["failed"]) == (3, 2, 1)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["ttft_s"]["p50"] == pytest.approx(1.25)
    assert s["itl_s"]["mean"] == pytest.approx(0.2)
    assert s["throughput_rps"] == pytest.approx(0.2)
    assert json.loads((tmp_path / "run_summary.json").read_text())["failed"] == 1
    assert len((tmp_path / "run_requests.csv").read_text().splitlines()) == 4


class _FakeOpenAI(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict] = []

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _FakeOpenAI.seen.append(req)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")  # as uvicorn streams
        self.end_headers()
        time.sleep(FIRST_TOKEN_DELAY)
        for i in range(req["max_tokens"]):
            if i:
                time.sleep(TOKEN_GAP)
            chunk = {"choices": [{"index": 0, "text": "x"}]}
            self._chunk(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FakeOpenAI.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _locust(host: str, prefix: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
           "--headless", "-r", "50", "-t", "60s", "--host", host, "--only-summary",
           "--tetris-output-tokens", "4", "--tetris-length-scale", "0.001",
           "--tetris-summary", str(prefix), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_open_loop_run_measures_ttft_and_itl(fake_server, tmp_path):
    proc = _locust(fake_server, tmp_path / "open", "-u", "1", "OpenLoopUser",
                   "--tetris-rate", "20", "--tetris-requests", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads((tmp_path / "open_summary.json").read_text())
    assert (s["requests"], s["succeeded"]) == (8, 8)
    assert s["output_tokens"] == 32
    assert FIRST_TOKEN_DELAY <= s["ttft_s"]["p50"] < FIRST_TOKEN_DELAY + 0.5
    assert TOKEN_GAP * 0.8 <= s["itl_s"]["p50"] < TOKEN_GAP + 0.2
    # Prompts are token-id lists of exactly the workload's (scaled) length, streamed, greedy.
    assert all(isinstance(r["prompt"], list) and r["stream"] and r["temperature"] == 0.0
               for r in _FakeOpenAI.seen)


def test_closed_loop_run_sends_every_request(fake_server, tmp_path):
    proc = _locust(fake_server, tmp_path / "closed", "-u", "3", "ClosedLoopUser",
                   "--tetris-requests", "6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads((tmp_path / "closed_summary.json").read_text())
    assert (s["requests"], s["succeeded"]) == (6, 6)


def test_non_loopback_host_is_refused(tmp_path):
    proc = _locust("http://192.0.2.1:8000", tmp_path / "x", "-u", "1", "OpenLoopUser",
                   "--tetris-requests", "1")
    assert proc.returncode != 0
    assert "not a loopback address" in proc.stderr + proc.stdout
