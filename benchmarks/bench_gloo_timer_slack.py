"""Does timer slack on gloo's transport thread delay collectives? (actors/timer_slack.py)

    python benchmarks/bench_gloo_timer_slack.py                   # 2 ranks, slack 0 and 50 ms
    python benchmarks/bench_gloo_timer_slack.py --ops 400 --json

Two processes form a gloo group through ``collectives.process_group`` (as the prefill world
does) once without slack and once with ``--slack-ms``, each in its own group in the same two
processes, used alternately round by round so the machine's noise falls on both alike. Each
round times ``--ops`` back-to-back all-reduces of a [1, hidden] float tensor (a TP decode step's
shape) and then one all-reduce after ``--idle-s`` of nothing (both transport threads asleep
in their 10 ms + slack wait: the wake-up a request sees on an idle server). Rank 0 also counts
its transport threads' wake-ups (voluntary context switches) over an idle second per group.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_threads() -> dict[int, int]:
    """tid -> voluntary context switches of this process's gloo transport threads."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "gloo_tcp_loop":
                status = (task / "status").read_text()
                out[int(task.name)] = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError):
            pass
    return out


def _rank(rank: int, port: int, args, out) -> None:
    from tetris.actors import collectives

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    groups, threads = {}, {}
    for slack in (0.0, args.slack_ms):
        os.environ["TETRIS_GLOO_TIMER_SLACK_MS"] = str(slack)
        before = set(_gloo_threads())
        groups[slack] = collectives.process_group(dist.PrefixStore(f"s{slack}", store), rank, 2,
                                                  "gloo", timedelta(seconds=60))
        t = torch.ones(1)
        groups[slack].allreduce([t]).wait()   # connected: its transport thread now exists
        threads[slack] = [tid for tid in _gloo_threads() if tid not in before]
    x = torch.randn(1, args.hidden)
    busy = {s: [] for s in groups}
    woken = {s: [] for s in groups}
    for _ in range(args.rounds):
        for slack, g in groups.items():
            for _ in range(args.ops):
                t0 = time.perf_counter()
                g.allreduce([x]).wait()
                busy[slack].append(time.perf_counter() - t0)
            time.sleep(args.idle_s)
            t0 = time.perf_counter()
            g.allreduce([x]).wait()
            woken[slack].append(time.perf_counter() - t0)
    wakes = {}
    for slack, tids in threads.items():
        c0 = _gloo_threads()
        time.sleep(1.0)
        c1 = _gloo_threads()
        wakes[slack] = sum(c1.get(t, 0) - c0.get(t, 0) for t in tids)
    if rank == 0:
        def ms(v, q):
            return round(1e3 * (statistics.median(v) if q == 50 else sorted(v)[int(len(v) * 0.99)]), 3)
        out.put({str(s): {"allreduce_p50_ms": ms(busy[s], 50), "allreduce_p99_ms": ms(busy[s], 99),
                          "after_idle_p50_ms": ms(woken[s], 50), "after_idle_max_ms": round(1e3 * max(woken[s]), 3),
                          "after_idle_over_5ms": sum(w > 0.005 for w in woken[s]),
                          "after_idle_ms": sorted(round(1e3 * w, 2) for w in woken[s]),
                          "transport_wakes_per_s_idle": wakes[s]} for s in groups})
    for g in groups.values():
        g.allreduce([torch.ones(1)]).wait()   # neither rank leaves before the other is done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slack-ms", type=float, default=50.0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ops", type=int, default=200, help="back-to-back all-reduces per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--idle-s", type=float, default=0.3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    result = {"slack_ms": {"0": result["0.0"], str(args.slack_ms): result[str(args.slack_ms)]},
              "hidden": args.hidden, "ops": args.ops, "rounds": args.rounds, "idle_s": args.idle_s}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{'slack ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'after idle p50':>15} {'max':>8} {'idle wakes/s':>13}")
        for s, r in result["slack_ms"].items():
            print(f"{s:>8} {r['allreduce_p50_ms']:>8.3f} {r['allreduce_p99_ms']:>8.3f} "
                  f"{r['after_idle_p50_ms']:>15.3f} {r['after_idle_max_ms']:>8.3f} "
                  f"{r['transport_wakes_per_s_idle']:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
