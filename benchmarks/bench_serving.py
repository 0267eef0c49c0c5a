"""Streaming overhead per token and the TTFT breakdown of the full system (Ray Serve app).

Starts the app on a deployment (default: the embedded tiny CPU one), streams requests over
HTTP and measures, side by side in one run:

- per token: the client-observed gap between SSE token events, the decode instance's engine
  step time (rank 0, rounds that made tokens), the driver's round time (step + Ray calls +
  lockstep), and gap minus step at the median: what the rounds, the Serve hops (decode pool
  -> dispatcher -> ingress) and SSE add per token;
- per request: TTFT seen by the client, split by the dispatcher's timeline into queue
  (arrival to first chunk), prefill (CDSP chunks), hand-off (KV transfer tail + admission +
  the first decode round) and the rest (ingress, tokenization, HTTP).

    python benchmarks/bench_serving.py --requests 8 --concurrency 1 --prompt-tokens 512
    python benchmarks/bench_serving.py --concurrency 4 --json

On CPU the absolute times are this machine's; the overhead is what to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time

import httpx
from tqdm import tqdm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _one(client: httpx.AsyncClient, base: str, model: str, prompt: list[int],
               max_tokens: int, per_token: bool = False) -> dict:
    """One streamed request: the stamp of every SSE event and, with ``per_token``
    (``stream_options.continuous_usage_stats``), how many tokens each event carried."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    counts: list[int] = []
    tokens = 0
    options = {"include_usage": True, **({"continuous_usage_stats": True} if per_token else {})}
    async with client.stream("POST", f"{base}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": options}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if not event.get("choices"):   # the closing usage-only event
                tokens = event["usage"]["completion_tokens"]
                continue
            stamps.append(time.perf_counter())
            if per_token:
                counts.append(event["usage"]["completion_tokens"])
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    # time per output token after the first (TPOT): the stream's span over its tokens
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 and len(stamps) > 1 else None
    per_token_gaps = []
    if per_token:   # an event of k new tokens: k gaps of (its gap / k)
        new = [b - a for a, b in zip(counts, counts[1:])]
        per_token_gaps = [g / k for g, k in zip(gaps, new) if k > 0 for _ in range(k)]
    return {"ttft": stamps[0] - t0, "gaps": gaps, "events": len(stamps), "tokens": tokens,
            "tpot": tpot, "per_token_gaps": per_token_gaps}


async def _drive(base: str, model: str, args) -> list[dict]:
    sem = asyncio.Semaphore(args.concurrency)
    bar = tqdm(total=args.requests, desc="requests", file=sys.stderr, disable=args.json)

    async with httpx.AsyncClient(timeout=600) as client:
        async def run(i: int) -> dict:
            async with sem:
                prompt = [(j * 31 + i * 7) % 500 + 3 for j in range(args.prompt_tokens)]
                out = await _one(client, base, model, prompt, args.max_tokens, args.per_token)
                bar.update(1)
                return out
        results = await asyncio.gather(*[run(i) for i in range(args.requests)])
    bar.close()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="deployment TOML (default: tiny-cpu.toml)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--per-token", action="store_true",
                   help="ask for usage in every event (continuous_usage_stats) to time each token")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from tetris.config import load_deployment
    from tetris.serve.app import APP_NAME, build_app

    dep = load_deployment(args.config)
    port = _free_port()
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(dep), name=APP_NAME, route_prefix="/")
        dispatcher = serve.get_deployment_handle("DispatcherServer", APP_NAME)
        decode = serve.get_deployment_handle("DecodePoolServer", APP_NAME)
        dispatcher.warmup.remote().result()
        base = f"http://127.0.0.1:{port}"
        asyncio.run(_drive(base, dep.model.name, argparse.Namespace(
            **{**vars(args), "requests": 2, "json": True})))          # warm-up, discarded
        before = len(dispatcher.timelines.remote(10_000).result())
        n_steps = len(decode.step_times.remote().result()[0]["step"])
        results = asyncio.run(_drive(base, dep.model.name, args))
        times = decode.step_times.remote().result()[0]
        steps, rounds = times["step"][n_steps:], times["round"][n_steps:]
        timelines = dispatcher.timelines.remote(10_000).result()[before:]
    finally:
        serve.shutdown()
        ray.shutdown()

    gaps = [g for r in results for g in r["gaps"]]
    ttft = [r["ttft"] for r in results]
    parts = {k: [t["breakdown"][k] for t in timelines] for k in ("queue_s", "prefill_s",
                                                                 "handoff_s", "ttft_s")}
    report = {
        "deployment": dep.source_path, "device": "cpu" if not _has_cuda() else "cuda",
        "requests": args.requests, "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "token_gap_p50_ms": 1e3 * _pct(gaps, 0.5), "token_gap_p90_ms": 1e3 * _pct(gaps, 0.9),
        "tokens_per_event": (sum(r["tokens"] for r in results) - len(results))
                            / max(1, sum(r["events"] - 1 for r in results)),
        "tpot_p50_ms": 1e3 * _pct([r["tpot"] for r in results if r["tpot"] is not None], 0.5),
        "per_token_gap_p50_ms": 1e3 * _pct([g for r in results for g in r["per_token_gaps"]], 0.5),
        "engine_step_p50_ms": 1e3 * _pct(steps, 0.5),
        "decode_round_p50_ms": 1e3 * _pct(rounds, 0.5),
        "overhead_per_token_p50_ms": 1e3 * (_pct(gaps, 0.5) - _pct(steps, 0.5)),
        "ttft_client_p50_ms": 1e3 * _pct(ttft, 0.5),
        "ttft_breakdown_p50_ms": {k: 1e3 * _pct(v, 0.5) for k, v in parts.items()},
        "ttft_outside_dispatcher_p50_ms": 1e3 * (_pct(ttft, 0.5) - _pct(parts["ttft_s"], 0.5)),
        "chunks_per_request": [t["chunks"] for t in timelines],
    }
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:32s} {v if not isinstance(v, float) else round(v, 2)}")
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
