"""Chrome-trace export (chrome://tracing, Perfetto) of a recorded simulation.

Prefill chunks are complete events (``ph: "X"``) on process "prefill pool", one thread per
instance; each request's KV arrival at its decode instance is an instant event on process
"decode". Times are microseconds of simulated time.
"""

from __future__ import annotations

import json
from pathlib import Path

from tetris.sim.prefill import ChunkRun

__all__ = ["chrome_trace", "write_chrome_trace"]


def chrome_trace(runs: list[ChunkRun], decode_reqs=(), num_instances: int | None = None) -> dict:
    events: list[dict] = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "prefill pool"}},
                          {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "decode"}}]
    n = num_instances if num_instances is not None else 1 + max(
        (i for r in runs for i in r.instances), default=-1)
    events += [{"ph": "M", "pid": 0, "tid": i, "name": "thread_name",
                "args": {"name": f"prefill {i}"}} for i in range(n)]
    for r in runs:
        for i in r.instances:
            events.append({"ph": "X", "pid": 0, "tid": i, "name": f"{r.request_id}/c{r.index}",
                           "ts": r.start * 1e6, "dur": (r.end - r.start) * 1e6,
                           "args": {"sp": len(r.instances), "history_tokens": r.history_tokens,
                                    "tokens": r.tokens, "expected_end_s": r.expected_end}})
    for d in decode_reqs:
        if d is None:
            continue
        events.append({"ph": "i", "pid": 1, "tid": 0, "s": "t", "name": f"{d.request_id} kv ready",
                       "ts": d.ready_time * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, runs: list[ChunkRun], decode_reqs=(),
                       num_instances: int | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(runs, decode_reqs, num_instances)))
    return path
