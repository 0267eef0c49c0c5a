"""``tetris bench soak``: its options, run and printout (the benchmark is ``tetris.bench.soak``)."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys

from tetris.bench.soak import MAX_GROWTH, run_soak
from tetris.cli.args import add_load_args, positive_float

__all__ = ["add_args", "run", "show"]


def add_args(p: argparse.ArgumentParser) -> None:
    add_load_args(p, load=0.7, duration=600.0)
    p.add_argument("--warmup", type=float, default=60.0, help="wall seconds before the baseline")
    p.add_argument("--sample-every", type=positive_float, default=10.0,
                   help="seconds between RSS samples")
    p.add_argument("--plot", default=None, help="write a PNG of RSS over time per actor here")
    p.add_argument("--trace-heap", action="store_true",
                   help="also run tracemalloc in the app's processes from warm-up end (slower; "
                        "the output then names the allocation sites that grew)")


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    # Ray's driver prints raylet warnings on stdout; --json must print one object there only.
    with contextlib.redirect_stdout(sys.stderr), tqdm(
            total=int(args.duration), desc="bench soak (EMULATION)", unit="s",
            disable=args.json, file=sys.stderr) as bar:
        try:
            return run_soak(args.config, workload=args.workload, capacity=args.capacity,
                            load=args.load, duration_s=args.duration, warmup_s=args.warmup,
                            sample_every_s=args.sample_every, time_scale=args.time_scale,
                            max_output=args.max_output, max_inflight=args.max_inflight,
                            drain_timeout_s=args.drain_timeout, seed=args.seed,
                            capacity_requests=args.capacity_requests, plot=args.plot,
                            trace_heap=args.trace_heap, tick=bar.update)
        except ValueError as e:
            raise SystemExit(f"tetris bench soak: {e}") from None


def show(out: dict) -> None:
    cap, req, v = out["capacity"], out["requests"], out["verdict"]
    print(f"{out['label']}; time scale {out['time_scale']:g}, {out['workload']} workload")
    print(f"capacity {cap['capacity_rps']:.2f} req/s ({cap['source']}), load {out['load']:g}: "
          f"{out['rate_rps']:.2f} req/s paper, {out['wall_rate_rps']:.3f} req/s wall, "
          f"{out['duration_s']:g} s (warm-up {out['warmup_s']:g} s)")
    print(f"requests sent {req['sent']}, completed {req['completed']}, failed {req['failed']}"
          + (f" ({'; '.join(req['errors'])})" if req["errors"] else ""))
    t = out["ttft_s"]
    print(f"TTFT P50 {t['p50']:.3f} s, P99 {t['p99']:.3f} s (paper seconds); arrival lag P99 "
          f"{out['arrival_lag_ms_p99']:.0f} ms")
    print(f"{'actor':24} {'pid':>8} {'private warm':>12} {'final MiB':>10} {'growth':>8} "
          f"{'RSS growth':>10} {'shared +MiB':>11}")

    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for a in out["memory"]["actors"]:
        print(f"{a['label']:24} {a['pid']:>8} {num(a['private_warm_mib'], '.1f'):>12} "
              f"{num(a['private_final_mib'], '.1f'):>10} "
              f"{num(a['growth'] and a['growth'] * 100, '+.2f'):>7}% "
              f"{num(a['rss_growth'] and a['rss_growth'] * 100, '+.2f'):>9}% "
              f"{num(a['shared_growth_mib'], '+.1f'):>11}"
              + (" LOST" if a["lost"] else "") + (" RESTARTED" if a["restarts"] else ""))
    _show_heap(out["memory"].get("heap", {}), {a["label"]: a["growth"] for a in out["memory"]["actors"]})
    print(f"held after drain: {'zero' if out['held_zero'] else out['held']}")
    print(f"zero failed: {'PASS' if v['zero_failed'] else 'FAIL'}; max growth "
          f"{v['max_growth'] * 100:.2f}% <= {MAX_GROWTH * 100:.0f}%: "
          f"{'PASS' if v['memory_growth_ok'] else 'FAIL'}")


def _show_heap(heap: dict, growth: dict) -> None:
    """What grew inside each process whose RSS grew past the criterion (``HeapProbe.diffs``)."""
    over = [label for label, g in growth.items() if g is not None and g > MAX_GROWTH and label in heap]
    for label in over:
        d = heap[label]
        if "error" in d:
            print(f"  heap {label}: {d['error']}")
            continue
        types = ", ".join(f"{t.rsplit('.', 1)[-1]} +{n}" for t, n in list(d["types_grown"].items())[:4])
        print(f"  heap {label}: RSS {d['rss_mib']:+.1f} MiB, malloc in use "
              f"{d.get('malloc_in_use_mib', math.nan):+.1f} MiB, malloc free "
              f"{d.get('malloc_free_mib', math.nan):+.1f} MiB, pymalloc arenas "
              f"{d.get('pymalloc_arenas_mib', math.nan):+.1f} MiB, objects {d['objects']:+d} ({types})")
        if "maps_mib" in d:
            kinds = ", ".join(f"{kind} {mib:+.1f}" for kind, mib in d["maps_mib"].items())
            print(f"    private by mapping (MiB): {kinds}; threads {d['threads']:+d}")
        for site in d.get("top_sites", [])[:3]:
            print(f"    {site['size_diff'] / 2 ** 20:+.2f} MiB at {site['frames'][-1]}")
