"""Prefix caching on the CPU prefill pool, for real (tiny seeded model, Ray workers, gloo): the
prefill time of a second question about a document planned from the first question's cached
KV, beside the same question without the cache, in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefix_cache_cpu.py [--doc-tokens 4096]
        [--question-tokens 64] [--repeats 3] [--instances 4] [--json]

Both control planes use the deployment's policy (tiny-cpu.toml: the A100 8B profile, so the
plans are the ones the served system would make, not tuned to this CPU); the cached one holds a
PrefixIndex of 16-token blocks. Each repeat uses a fresh document: question 1 (cold), then
question 2 with the cache and question 2 without it, alternating which of the two runs first.
The time is ``PrefillPool.run``'s wall time (the first token's, TTFT without queueing or
the HTTP hops); medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec
import ray
import torch
from tetris.actors.prefill.pool import PrefillPool

from tetris.config import load_deployment
from tetris.control import ControlPlane, PrefillQueue
from tetris.control.prefix_index import PrefixIndex
from tetris.scheduler.policies import policy_from_config


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _plane(deployment, pool, index):
    return ControlPlane(policy_from_config(deployment.scheduler), PrefillQueue(pool.node_of),
                        None, improvement_rate=0.3, prefix_index=index)


def _timed(cp, pool, run_id, ids, t0):
    now = time.monotonic() - t0
    hashes = cp.prefix_index.hashes(ids) if cp.prefix_index is not None else None
    plan = cp.plan(run_id, len(ids), now, block_hashes=hashes)
    cp.commit(plan)
    start = time.perf_counter()
    res = pool.run(plan, ids)
    took = time.perf_counter() - start
    cp.prefill_done(run_id, time.monotonic() - t0)
    cp.prefix_cached(run_id)
    return took, plan, res.first_token


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dep = load_deployment("tiny-cpu.toml")
    dep = msgspec.structs.replace(dep, prefill=msgspec.structs.replace(
        dep.prefill, kv_blocks_per_instance=4096))
    ray.init(num_cpus=max(8, args.instances * 2), include_dashboard=False, log_to_driver=False)
    pool = PrefillPool(dep, num_instances=args.instances, node_size=2, timeout_s=60.0)
    t0 = time.monotonic()
    rows = []
    try:
        for rep in range(args.repeats):
            index = PrefixIndex(16, capacity_blocks=1 << 16)
            cached_cp, plain_cp = _plane(dep, pool, index), _plane(dep, pool, None)
            doc = _ids(args.doc_tokens, seed=100 + rep)
            q1 = doc + _ids(args.question_tokens, seed=200 + rep)
            q2 = doc + _ids(args.question_tokens, seed=300 + rep)
            first, _, _ = _timed(cached_cp, pool, f"q1-{rep}", q1, t0)
            order = ["cached", "plain"] if rep % 2 == 0 else ["plain", "cached"]
            got = {}
            for kind in order:
                cp = cached_cp if kind == "cached" else plain_cp
                got[kind] = _timed(cp, pool, f"q2-{kind}-{rep}", q2, t0)
            assert got["cached"][2] == got["plain"][2], "caching changed the first token"
            rows.append({"q1_s": first, "q2_cached_s": got["cached"][0],
                         "q2_plain_s": got["plain"][0],
                         "cached_tokens": got["cached"][1].cached_tokens,
                         "plan_cached": [c.sp_size for c in got["cached"][1].chunks],
                         "plan_plain": [c.sp_size for c in got["plain"][1].chunks]})
            for r in (f"q1-{rep}", f"q2-cached-{rep}", f"q2-plain-{rep}"):
                pool.release(r)
    finally:
        pool.shutdown()
        ray.shutdown()
    med = {k: statistics.median(r[k] for r in rows) for k in ("q1_s", "q2_cached_s", "q2_plain_s")}
    out = {"doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
           "instances": args.instances, "rows": rows, "median": med,
           "cached_over_plain": med["q2_cached_s"] / med["q2_plain_s"]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"CPU, tiny seeded model, {args.instances} prefill workers; document "
          f"{args.doc_tokens} + question {args.question_tokens} tokens; {args.repeats} repeats")
    for r in rows:
        print(f"  q1 {r['q1_s']:.3f} s | q2 cached {r['q2_cached_s']:.3f} s "
              f"({r['cached_tokens']} tokens cached, SP {r['plan_cached']}) | q2 without "
              f"{r['q2_plain_s']:.3f} s (SP {r['plan_plain']})")
    print(f"median: q1 {med['q1_s']:.3f} s, q2 cached {med['q2_cached_s']:.3f} s, q2 without "
          f"{med['q2_plain_s']:.3f} s; cached / without {out['cached_over_plain']:.3f}")


if __name__ == "__main__":
    main()
