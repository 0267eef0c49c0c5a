"""The token path, side by side: the single engine's time per token, and the served system's
client-observed gap between tokens, for this tree and (optionally) an older one.

Each served run is ``benchmarks/bench_serving.py --json`` of its tree in a fresh process (its
own Ray instance); the single engine runs here, on the same deployment's model. Ratios are
what to read on this noisy 2-core machine: gap / engine time per token, gap / decode round.

    python benchmarks/bench_token_path.py --requests 8
    python benchmarks/bench_token_path.py --baseline-root /tmp/base --baseline-python /tmp/venv_old/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def engine_time_per_token(config: str | None, prompt_tokens: int, max_tokens: int) -> float:
    """Median decode step of the single-instance engine, one request, after its prefill."""
    from tetris.config import load_deployment
    from tetris.engine.engine import LLMEngine
    from tetris.model.loader import load_model
    from tetris.sampling_params import SamplingParams

    dep = load_deployment(config)
    model, tokenizer = load_model(dep.model)
    bs = dep.decode.block_size
    engine = LLMEngine(model, tokenizer, num_blocks=-(-(prompt_tokens + max_tokens + 1) // bs),
                       block_size=bs, max_num_seqs=1)
    prompt = [(j * 31) % 500 + 3 for j in range(prompt_tokens)]
    engine.add_request("e", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return statistics.median(steps[1:])   # the first step is the prefill


def served(python: str, root: Path, config: str | None, requests: int, concurrency: int,
           prompt_tokens: int, max_tokens: int, per_token: bool) -> dict:
    """``bench_serving.py`` of this tree (the client side) against the server of ``root``'s
    tree, installed in ``python``'s environment."""
    cmd = [python, str(ROOT / "benchmarks" / "bench_serving.py"), "--json",
           "--requests", str(requests), "--concurrency", str(concurrency),
           "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens)]
    if config:
        cmd += ["--config", config]
    if per_token:
        cmd.append("--per-token")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="deployment TOML (default: tiny-cpu.toml)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,8", help="comma-separated concurrency levels")
    p.add_argument("--baseline-root", type=Path, default=None,
                   help="an older checkout (a git worktree) to run beside this one")
    p.add_argument("--baseline-python", default=None,
                   help="the Python whose environment has the baseline checkout installed")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    token_s = engine_time_per_token(args.config, args.prompt_tokens, args.max_tokens)
    # the baseline's API may refuse continuous_usage_stats: it is timed by TPOT only
    trees = [("this tree", sys.executable, ROOT, True)]
    if args.baseline_root is not None:
        trees.insert(0, ("baseline", args.baseline_python or sys.executable, args.baseline_root,
                         False))
    rows = []
    for label, python, root, per_token in trees:
        for c in [int(x) for x in args.concurrency.split(",")]:
            r = served(python, root, args.config, max(args.requests, c), c, args.prompt_tokens,
                       args.max_tokens, per_token)
            gap, rnd, tpot = r["token_gap_p50_ms"], r["decode_round_p50_ms"], r["tpot_p50_ms"]
            parts = r["ttft_breakdown_p50_ms"]
            rows.append({"tree": label, "concurrency": c, "event_gap_p50_ms": gap,
                         "event_gap_p90_ms": r["token_gap_p90_ms"],
                         "tokens_per_event": r["tokens_per_event"], "tpot_p50_ms": tpot,
                         "per_token_gap_p50_ms": r.get("per_token_gap_p50_ms"),
                         "round_p50_ms": rnd, "step_p50_ms": r["engine_step_p50_ms"],
                         "tpot_over_engine_token": tpot / (1e3 * token_s),
                         "tpot_over_round": tpot / rnd,
                         "event_gap_over_round": gap / rnd,
                         "ttft_p50_ms": r["ttft_client_p50_ms"],
                         "ttft_outside_prefill_ms": r["ttft_client_p50_ms"] - parts["prefill_s"],
                         "queue_ms": parts["queue_s"], "handoff_ms": parts["handoff_s"]})
    report = {"label": "CPU, tiny deployment unless --config; ratios measured in one run",
              "engine_token_ms": 1e3 * token_s, "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"single engine: {1e3 * token_s:.2f} ms per token")
    cols = ["tree", "concurrency", "event_gap_p50_ms", "tokens_per_event", "tpot_p50_ms",
            "round_p50_ms", "tpot_over_engine_token", "tpot_over_round", "event_gap_over_round",
            "ttft_p50_ms", "ttft_outside_prefill_ms"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
