"""Cache balancing overlapped vs not overlapped, on a pool of prefill actors (paper Fig. 14 a-d).

Scenario (paper §7, "CDSP Cache Balancing"): a request's history of ``ratio * L`` tokens was
prefilled on one node's instances; the next chunk of ``L`` tokens runs on twice as many
instances over two nodes, so before it the old members forward half of their history KV to the
new ones (Fig. 5). Three modes run side by side in one process, interleaved round by round:

- ``overlap``:  layer i+1's moves run during layer i's MLP (Fig. 6-b);
- ``blocking``: each layer's moves are waited for before its attention (no overlap);
- ``off``:      no balancing (history stays on the old members; same results, uneven attention).

Reported per history ratio: median time of the balanced chunk, the ratio blocking / overlap,
and the exposed balancing share: time members spent blocked on balancing / chunk time.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefill_balance.py [--chunk-tokens 2048]
        [--ratios 0.25 0.5 1 2] [--repeats 3] [--instances 8] [--node-size 4] [--json]

CPU caveat: every actor here shares the machine's few cores (two on the CI box) with the
others, so "parallel" members are time-sliced; absolute times and the overlap gain are not
those of GPUs with their own links, only a side-by-side comparison on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import msgspec

MODES = ("overlap", "blocking", "off")


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny-cpu.toml")
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--node-size", type=int, default=4)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray
    import torch
    from tqdm import tqdm

    from tetris.actors.prefill.pool import PrefillPool
    from tetris.config import load_deployment
    from tetris.plan import Chunk, PrefillPlan

    torch.set_num_threads(1)
    cfg = load_deployment(args.config)
    cfg = msgspec.structs.replace(cfg, prefill=msgspec.structs.replace(
        cfg.prefill, executor="model"))
    ray.init(num_cpus=64, include_dashboard=False, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    pool = PrefillPool(cfg, num_instances=args.instances, node_size=args.node_size,
                       timeout_s=120.0)
    old = tuple(range(args.instances // 2))
    new = tuple(range(args.instances))
    rows = []
    runs = [(r, k, m) for r in args.ratios for k in range(args.repeats) for m in MODES]
    samples: dict[tuple[float, str], list] = {}
    try:
        # Warm-up (first calls pay for lazy initialisation in every actor), not recorded.
        for mode in MODES:
            warm = PrefillPlan(f"warm-{mode}", 512, (Chunk(0, 256, old), Chunk(256, 512, new)))
            pool.run(warm, [1] * 512, balance=mode)
            pool.release(warm.request_id)
        for ratio, k, mode in tqdm(runs, desc="prefill runs", disable=args.json):
            hist = max(1, int(ratio * args.chunk_tokens))
            n = hist + args.chunk_tokens
            plan = PrefillPlan(f"bench-{ratio}-{k}-{mode}", n,
                               (Chunk(0, hist, old), Chunk(hist, n, new)))
            ids = torch.randint(0, cfg.model.vocab_size, (n,),
                                generator=torch.Generator().manual_seed(k)).tolist()
            res = pool.run(plan, ids, balance=mode)
            pool.release(plan.request_id)
            samples.setdefault((ratio, mode), []).append(res)
    finally:
        pool.shutdown()
        ray.shutdown()
    for ratio in args.ratios:
        row = {"history_ratio": ratio, "history_tokens": max(1, int(ratio * args.chunk_tokens)),
               "chunk_tokens": args.chunk_tokens}
        for mode in MODES:
            rs = samples[(ratio, mode)]
            chunk_s = statistics.median(r.chunk_elapsed_s[1] for r in rs)
            wait_s = statistics.median(r.balance_wait_s for r in rs)
            row[f"{mode}_chunk_s"] = round(chunk_s, 4)
            row[f"{mode}_balance_wait_s"] = round(wait_s, 4)
            row[f"{mode}_balance_share"] = round(wait_s / chunk_s, 4)
            row["moved_tokens"] = rs[0].balance_moved_tokens if mode != "off" else row.get(
                "moved_tokens", 0)
        row["blocking_over_overlap"] = round(row["blocking_chunk_s"] / row["overlap_chunk_s"], 3)
        row["overlap_over_off"] = round(row["overlap_chunk_s"] / row["off_chunk_s"], 3)
        rows.append(row)
    report = {
        "benchmark": "prefill_cache_balancing",
        "instances": args.instances, "node_size": args.node_size, "model": cfg.model.name,
        "repeats": args.repeats, "cpu_cores": os.cpu_count(),
        "caveat": "CPU, gloo, all actors time-sliced on the same few cores; ratios only",
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{'hist/L':>6} {'moved':>6} {'overlap s':>9} {'blocking s':>10} {'off s':>7} "
              f"{'block/ovl':>9} {'ovl/off':>7} {'exposed share ovl':>17} {'blk':>6}")
        for r in rows:
            print(f"{r['history_ratio']:>6} {r['moved_tokens']:>6} {r['overlap_chunk_s']:>9.3f} "
                  f"{r['blocking_chunk_s']:>10.3f} {r['off_chunk_s']:>7.3f} "
                  f"{r['blocking_over_overlap']:>9.3f} {r['overlap_over_off']:>7.3f} "
                  f"{100 * r['overlap_balance_share']:>16.2f}% "
                  f"{100 * r['blocking_balance_share']:>5.2f}%")
        print(report["caveat"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
