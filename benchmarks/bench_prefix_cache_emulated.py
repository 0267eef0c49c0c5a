"""EMULATION and SIMULATION side by side: prefix caching on the paper's 8B cluster with the
shared-prefix workload, the cache off and on, the same seeded trace in both.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefix_cache_emulated.py [--documents 3]
        [--sessions 2] [--rate 1] [--seed 0] [--time-scale 4] [--max-output 16] [--json]

EMULATION: the live Serve app of ``paper-llama3-8b-emulated.toml`` (16 emulated prefill
instances, 2 emulated TP-8 decode instances, emulated KV transfer; no model runs), slowed by
``--time-scale`` as ``tetris bench fidelity`` slows it, times divided back to paper seconds.
SIMULATION: ``tetris.sim`` on the same cluster, policy (θ = 0.3) and trace, prefill only.
Outputs are capped to ``--max-output`` tokens for the live runs (TTFT does not depend on them).

``--decode-runs N``: a third setting, the cache with decode-side reuse (N finished runs kept
per decode instance: a session's next turn is routed to the instance keeping its previous
turn, which shares those blocks instead of receiving them); the SIMULATION then models the
decode instances for every setting (``run_prefix(decode=True)``: "KV on decode" is arrival to
the last of a request's KV there). Live, a next turn shares its previous turn's prompt blocks
(the emulated decode's answer tokens are not the workload's, so the answer's are streamed).

``--capacity``: capacity with the cache off and on, EMULATION beside SIMULATION
(``prefix_capacity_emulated.py``); the TTFT rows then come from the capacity probes at
``--rate``, with a per-request breakdown of the live TTFT against the simulated one.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import msgspec
import numpy as np

from tetris.bench.fidelity_live import start_ray
from tetris.bench.prefix_live import run_live
from tetris.config import load_deployment
from tetris.sim.prefix_experiments import default_capacity_blocks, run_prefix
from tetris.sim.prefix_workload import (
    PrefixWorkload,
    decode_kept_hashes,
    shared_prefix_prompts,
)

# setting -> (cache on, decode runs kept per instance)
SETTINGS = {"off": (False, 0), "on": (True, 0)}


def _pct(xs, q: float) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.percentile(xs, q)) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="paper-llama3-8b-emulated.toml")
    ap.add_argument("--documents", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--capacity", action="store_true")
    ap.add_argument("--slo-factor", type=float, default=3.0)
    ap.add_argument("--lo", type=float, default=0.5)
    ap.add_argument("--hi", type=float, default=1.0)
    ap.add_argument("--tol", type=float, default=0.25)
    ap.add_argument("--max-rate", type=float, default=8.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--only", choices=("", "on", "off"), default="",
                    help="with --capacity: one setting only")
    ap.add_argument("--decode-runs", type=int, default=0,
                    help="> 0: a third setting with decode-side reuse (not with --capacity)")
    args = ap.parse_args()
    if args.capacity:
        from prefix_capacity_emulated import run_capacity

        run_capacity(args)
        return
    spec = PrefixWorkload(documents=args.documents, sessions=args.sessions)
    items = shared_prefix_prompts(spec, args.rate, args.seed)
    trace = [msgspec.structs.replace(r, output_tokens=min(r.output_tokens, args.max_output))
             for r, _ in items]
    segments = {r.request_id: s for r, s in items}
    blocks = default_capacity_blocks("8b", spec.block_tokens)
    settings = dict(SETTINGS)
    if args.decode_runs > 0:
        settings["on+decode"] = (True, args.decode_runs)
    decode = args.decode_runs > 0
    # what a decode instance keeps of a run: its prompt and its capped answer
    kept = (decode_kept_hashes([(r, segs) for r, (_, segs) in zip(trace, items)],
                               spec.block_tokens) if decode else None)
    sim = {name: run_prefix(trace, cache=c, rate=args.rate, block_tokens=spec.block_tokens,
                            capacity_blocks=blocks, decode=decode, decode_runs=n,
                            kept=kept)[0]
           for name, (c, n) in settings.items()}
    base = load_deployment(args.config)
    start_ray()
    live = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (c, n) in settings.items():
            live[name] = run_live(base, trace, segments, cache=c,
                                  block_tokens=spec.block_tokens, capacity_blocks=blocks,
                                  time_scale=args.time_scale, workdir=Path(tmp), decode_runs=n)
    rows = [_row(name, sim[name], live[name]) for name in settings]
    if args.json:
        print(json.dumps({"args": vars(args), "requests": len(trace),
                          "mean_prompt_tokens": sum(r.prompt_tokens for r in trace) / len(trace),
                          "rows": rows}))
        return
    _print(args, trace, rows)


def _row(name: str, sim, live: dict) -> dict:
    return {"setting": name, "cache": name != "off", "sim_p50": sim.ttft_p50,
            "sim_p99": sim.ttft_p99, "sim_planned_from_cache": sim.hit_rate,
            "sim_kv_on_decode_p50": sim.kv_ready_p50, "sim_decode_reuses": sim.decode_reuses,
            "live_p50": _pct(live["ttft_s"], 50), "live_p99": _pct(live["ttft_s"], 99),
            "live_prefill_p50": _pct(live["prefill_ttft_s"], 50),
            "live_prefill_p99": _pct(live["prefill_ttft_s"], 99),
            "live_hits": live["index"].get("hits", 0),
            "live_queries": live["index"].get("queries", 0),
            "live_decode_reuses": live["probe_hits"].get("decode_reuses", 0),
            "failed": live["failed"], "errors": live["errors"],
            "held_after_clear": live["held_after_clear"], "wall_s": live["wall_s"]}


def _print(args, trace, rows) -> None:
    mean = sum(r.prompt_tokens for r in trace) / len(trace)
    print(f"EMULATION (live, time scale {args.time_scale:g}) beside SIMULATION; "
          f"{len(trace)} requests, mean prompt {mean / 1e3:.1f}k tokens, rate {args.rate:g} "
          f"req/s, seed {args.seed}; paper seconds")
    print("| setting | SIM P50 / P99 | EMU P50 / P99 | EMU to prefill end P50 / P99 "
          "| EMU / SIM P50 | planned from cache SIM / EMU | decode reuses SIM / EMU | failed "
          "| held after clear (inflight/prefill runs/decode ranks) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        emu_hits = (f"{r['live_hits']}/{r['live_queries']}" if r["cache"] else "-")
        print(f"| {r['setting']} | {r['sim_p50']:.3f} / {r['sim_p99']:.3f} "
              f"| {r['live_p50']:.3f} / {r['live_p99']:.3f} "
              f"| {r['live_prefill_p50']:.3f} / {r['live_prefill_p99']:.3f} "
              f"| {r['live_p50'] / r['sim_p50']:.2f} "
              f"| {r['sim_planned_from_cache']:.0%} / {emu_hits} "
              f"| {r['sim_decode_reuses']} / {r['live_decode_reuses']} | {r['failed']} "
              f"| {'/'.join(str(v) for v in r['held_after_clear'].values())} |")
    off = rows[0]
    for on in rows[1:]:
        print(f"{on['setting']} / off: SIM P50 {on['sim_p50'] / off['sim_p50']:.2f}, P99 "
              f"{on['sim_p99'] / off['sim_p99']:.2f}; EMU P50 "
              f"{on['live_p50'] / off['live_p50']:.2f}, P99 "
              f"{on['live_p99'] / off['live_p99']:.2f}")
    for r in rows:
        if r["errors"]:
            print(f"errors ({r['setting']}): {r['errors']}")


if __name__ == "__main__":
    main()
