"""Idle CPU of `tetris serve` with Ray's default timers and with Tetris's idle settings, side by side.

    python benchmarks/bench_idle_cpu_compare.py                    # 3 windows of 30 s
    python benchmarks/bench_idle_cpu_compare.py --repeat 5 --json
    python benchmarks/bench_idle_cpu_compare.py --env RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5

Starts two ``tetris serve`` on the same deployment at the same time: "before" with
``TETRIS_RAY_IDLE_DEFAULTS=1`` (Ray's and Serve's own timer periods), "after" with the settings
of ``tetris/serve/ray_idle.py`` (``--env`` adds or overrides some for "after" only). Sends one
completion to each, waits for both to settle, then measures both process trees over the SAME
window, ``--repeat`` times: the machine's noise falls on both alike. The CPU time (user +
system) of every process of each tree is summed as % of one core, ALL processes: the driver,
Ray's gcs_server, raylet, dashboard agent, log monitor, Serve's controller and proxy, the
replicas, the prefill workers and decode ranks. ``bench_idle_cpu.py`` measures one server.

Exit status 1 when "after"'s median over the windows, all processes, reaches ``--limit``
(5% of one core: issue #20's target).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_idle_cpu as idle

VARIANTS = ("before", "after")


def per_name(result: dict) -> dict[str, tuple[int, float]]:
    """(process count, % of one core summed) per process name of one measurement."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for r in result["processes"]:
        out[r["name"]][0] += 1
        out[r["name"]][1] += r["cpu_pct"]
    return {k: (n, round(v, 2)) for k, (n, v) in out.items()}


def thread_totals(result: dict) -> dict[str, float]:
    """% of one core per thread name, summed over the tree's processes (``--threads``)."""
    out: dict[str, float] = defaultdict(float)
    for r in result["processes"]:
        for t in r.get("threads", []):
            name = f"main thread ({r['category']})" if t["tid"] == r["pid"] else t["name"]
            out[name] += t["cpu_pct"]
    return {k: round(v, 2) for k, v in out.items()}


def summarize(windows: list[dict[str, dict]]) -> dict:
    """Median over the windows, per variant: totals, per process name and per thread name."""
    def med(values):
        return round(statistics.median(values), 2)

    out = {}
    for v in VARIANTS:
        runs = [w[v] for w in windows]
        names = sorted({n for r in runs for n in per_name(r)})
        threads = sorted({n for r in runs for n in thread_totals(r)})
        out[v] = {
            "all_pct": [r["all_pct"] for r in runs], "all_pct_median": med([r["all_pct"] for r in runs]),
            "by_category": {c: med([r["total_pct"][c] for r in runs]) for c in ("tetris", "serve", "ray")},
            "by_process": {n: {"count": max(per_name(r).get(n, (0, 0))[0] for r in runs),
                               "pct": med([per_name(r).get(n, (0, 0.0))[1] for r in runs])}
                           for n in names},
            "by_thread": {n: med([thread_totals(r).get(n, 0.0) for r in runs]) for n in threads},
        }
    return out


def print_summary(s: dict, limit: float) -> None:
    b, a = s["before"], s["after"]
    print(f"{'process (count)':<36} {'before %':>9} {'after %':>9}")
    names = sorted(set(b["by_process"]) | set(a["by_process"]),
                   key=lambda n: -b["by_process"].get(n, {"pct": 0})["pct"])
    for n in names:
        pb, pa = b["by_process"].get(n, {"count": 0, "pct": 0.0}), a["by_process"].get(n, {"count": 0, "pct": 0.0})
        label = f"{n[:30]} ({max(pb['count'], pa['count'])})"
        print(f"{label:<36} {pb['pct']:>9.2f} {pa['pct']:>9.2f}")
    if b["by_thread"]:
        print(f"\n{'thread name, all processes':<36} {'before %':>9} {'after %':>9}")
        for n in sorted(set(b["by_thread"]) | set(a["by_thread"]), key=lambda n: -b["by_thread"].get(n, 0)):
            print(f"{n[:36]:<36} {b['by_thread'].get(n, 0):>9.2f} {a['by_thread'].get(n, 0):>9.2f}")
    print()
    for c in ("tetris", "serve", "ray"):
        print(f"{'category ' + c:<36} {b['by_category'][c]:>9.2f} {a['by_category'][c]:>9.2f}")
    print(f"{'ALL processes (median)':<36} {b['all_pct_median']:>9.2f} {a['all_pct_median']:>9.2f}"
          f"   (limit {limit:g}%; per window: before {b['all_pct']}, after {a['all_pct']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(idle.ROOT / "configs" / "tiny-cpu.toml"))
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--repeat", type=int, default=3, help="windows measured (both servers in each)")
    ap.add_argument("--settle-s", type=float, default=10.0)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=8, metavar="N",
                    help="per process, the N busiest threads enter the per-thread table")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="an environment variable for the 'after' server only")
    ap.add_argument("--limit", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    envs = {"before": {"TETRIS_RAY_IDLE_DEFAULTS": "1"},
            "after": dict(kv.split("=", 1) for kv in args.env)}
    log_dir = Path(tempfile.mkdtemp(prefix="tetris-idle-cmp-"))
    procs = {}
    try:
        for v in VARIANTS:   # launched together, started in parallel
            procs[v] = idle.launch_server(args.config, idle._free_port(), log_dir / f"{v}.log",
                                          env=envs[v])
        urls = {v: idle.wait_ready(procs[v], log_dir / f"{v}.log", args.start_timeout_s) for v in VARIANTS}
        for v in VARIANTS:
            body = {"model": idle._model_name(urls[v]), "prompt": "Tetris fills the gaps " * 20,
                    "max_tokens": 8, "temperature": 0}
            idle._post(f"{urls[v]}/v1/completions", body, timeout=300)
        time.sleep(args.settle_s)
        windows = []
        for _ in range(args.repeat):
            got = idle.measure_many([procs[v].pid for v in VARIANTS], args.window_s,
                                    top_threads=args.threads)
            windows.append(dict(zip(VARIANTS, got)))
    finally:
        for p in procs.values():
            idle.stop_server(p)
    summary = summarize(windows)
    summary.update(config=args.config, window_s=args.window_s, repeat=args.repeat,
                   after_env=envs["after"], limit_pct=args.limit,
                   ok=summary["after"]["all_pct_median"] < args.limit)
    if args.json:
        print(json.dumps({"summary": summary, "windows": windows}, indent=1))
    else:
        print_summary(summary, args.limit)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
