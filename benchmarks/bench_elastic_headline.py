"""Elastic vs whole-request decode placement: SIMULATION beside EMULATION (issue #25 headline).

The paper's 8B cluster emulated (``configs/paper-llama3-8b-emulated.toml``: 16 TP-1 prefill
workers, 2 TP-8 decode instances, A100 profile, fixed θ), the Long workload with every
``--tail-every``-th prompt a ``--tail-tokens`` one. Per placement (``[decode] elastic`` off,
on) and rate, the simulator and the live emulated app run the same seeded trace
(``tetris.bench.elastic_headline``). ``--kv-tokens`` sets each decode instance's KV capacity
(default: the deployment's, 4.27M tokens); below the tail's size whole placement refuses the
tail (429) and elastic placement spreads it over both instances.

    OMP_NUM_THREADS=1 python benchmarks/bench_elastic_headline.py --rates 0.1,0.2 \\
        --requests 12 --tail-every 8 --kv-tokens 640000 --time-scale 1 --json out.json
    python benchmarks/bench_elastic_headline.py --sim-only --requests 200 --rates 0.1,0.2,0.3

Sustainable (coarse, per rate tried): every request served, the TTFT P99 within
``--ttft-slo`` (200 s: about twice a 1M-token prefill's 92 s) and the TBT P99 within
``--tbt-slo`` (0.1 s) paper seconds; "of what it serves" ignores the refused ones.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from tetris.bench.elastic_headline import (
    elastic_trace,
    placement,
    run_live,
    simulate_placement,
)
from tetris.config import load_deployment


def _row(side: str, name: str, rate: float, r: dict) -> str:
    tbt = r["tbt_s"] or {"p50": float("nan"), "p99": float("nan")}
    extra = f" sharded {r['sharded']}" if "sharded" in r else f" failed {r['failed']}"
    return (f"{side:10s} {name:7s} {rate:5.2f} req/s: TTFT P50/P99 {r['ttft_s']['p50']:7.2f} / "
            f"{r['ttft_s']['p99']:7.2f} s, TBT P50/P99 {1e3 * tbt['p50']:6.1f} / "
            f"{1e3 * tbt['p99']:6.1f} ms, served {r['served']}, refused {r['refused']}{extra}")


def _sustainable(runs: dict, slo: float, tbt_slo: float, served_only: bool) -> float:
    ok = [rate for rate, r in runs.items()
          if (served_only or r["refused"] == 0) and r["served"] > 0
          and r.get("failed", r["refused"]) - r["refused"] == 0 and r["ttft_s"]["p99"] <= slo
          and r["tbt_s"]["p99"] <= tbt_slo]
    return max(ok, default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="paper-llama3-8b-emulated.toml")
    ap.add_argument("--workload", default="long")
    ap.add_argument("--rates", default="0.1,0.2")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tail-every", type=int, default=8)
    ap.add_argument("--tail-tokens", type=int, default=1_000_000)
    ap.add_argument("--kv-tokens", type=int, default=None)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--ttft-slo", type=float, default=200.0)
    ap.add_argument("--tbt-slo", type=float, default=0.1)
    ap.add_argument("--sim-only", action="store_true")
    ap.add_argument("--consolidate", action="store_true", help="simulated runs consolidate")
    ap.add_argument("--placements", default="whole,elastic")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = load_deployment(args.config)
    rates = [float(r) for r in args.rates.split(",")]
    traces = {rate: elastic_trace(args.workload, rate, args.requests, args.seed, args.max_output,
                                  args.tail_every, args.tail_tokens) for rate in rates}
    out = {"config": args.config, "args": vars(args), "settings": {}}
    print(f"{args.config}, {args.workload} + a {args.tail_tokens}-token prompt every "
          f"{args.tail_every}, {args.requests} requests, seed {args.seed}, outputs <= "
          f"{args.max_output}, decode KV per instance "
          f"{args.kv_tokens or base.decode.kv_blocks * base.decode.block_size} tokens")
    for name in args.placements.split(","):
        elastic = {"whole": False, "elastic": True}[name]
        cfg = placement(base, elastic, args.kv_tokens, args.tail_tokens + args.max_output)
        sim = {rate: simulate_placement(cfg, trace, args.consolidate)
               for rate, trace in traces.items()}
        setting = {"SIMULATION": sim}
        for rate, r in sim.items():
            print(_row("SIMULATION", name, rate, r))
        if not args.sim_only:
            load0, t0 = os.getloadavg()[0], time.perf_counter()
            for attempt in range(3):   # Ray's start-up times out on a loaded machine
                try:
                    with tempfile.TemporaryDirectory(prefix="tetris-elastic-") as tmp:
                        live = run_live(cfg, traces, args.time_scale, Path(tmp))
                    break
                except Exception as e:   # only a failed start is retried
                    if "during startup" not in str(e) or attempt == 2:
                        raise
                    print(f"EMULATION {name}: Ray did not start ({e}); again")
            live["load_average_1m"] = [load0, os.getloadavg()[0]]
            live["wall_s"] = time.perf_counter() - t0
            setting["EMULATION"] = live
            for rate in rates:
                print(_row("EMULATION", name, rate, live[rate]))
            print(f"EMULATION {name}: wall {live['wall_s']:.0f} s, load average {load0:.1f} "
                  f"before, {os.getloadavg()[0]:.1f} after")
        for side in list(setting):
            runs = {rate: setting[side][rate] for rate in rates}
            setting[f"{side}_sustainable"] = {
                "all_served": _sustainable(runs, args.ttft_slo, args.tbt_slo, False),
                "of_what_it_serves": _sustainable(runs, args.ttft_slo, args.tbt_slo, True)}
            print(f"{side} {name}: sustainable (of the rates tried) "
                  f"{setting[f'{side}_sustainable']}")
        out["settings"][name] = setting
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
