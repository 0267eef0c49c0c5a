"""EMULATION: one cached request's timeline on the emulated prefill pool of the paper's 8B
cluster, against what the simulator charges it (the EMULATION/SIMULATION TTFT gap with the
cache on, docs/prefix_cache.md).

    OMP_NUM_THREADS=1 python benchmarks/bench_prefix_cache_profile.py [--holders 4,16]
        [--prefix 64000] [--suffix 256] [--repeats 3] [--json]

The pool of ``paper-llama3-8b-emulated.toml`` alone (16 emulated prefill workers on Ray, paper
time, no Serve, no decode side). Per repeat and holder count H: a source run of ``--prefix``
tokens on H instances, then (a) a run of ``--suffix`` tokens from that cached prefix on the
same H instances and (b) a cold run of ``--suffix`` tokens on H (no prefix: the same chunk
shape without the copy). ``PrefillPool.run``'s wall time splits into the turn wait
(``queued_s``), the chunk (``elapsed_s``, what Eq. 1 charges) and the rest: the Ray rounds
before the chunk, for (a) the ``adopt_prefix`` round on the H holders. The simulator charges
a cached run Eq. 1 alone (``T_H(prefix, suffix)``) and the copy nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tetris.config import load_deployment
from tetris.plan import Chunk, PrefillPlan
from tetris.scheduler.latency import load_profile


def _timed(pool, plan, tokens: int) -> dict:
    t0 = time.perf_counter()
    res = pool.run(plan, [1] * tokens)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "queued_s": res.queued_s, "chunk_s": res.elapsed_s,
            "rest_s": wall - res.queued_s - res.elapsed_s}


def profile_holders(pool, profile, h: int, prefix: int, suffix: int, k: int) -> dict:
    group = tuple(range(h))
    src = PrefillPlan(f"src{h}-{k}", prefix, (Chunk(0, prefix, group),)).validate(pool.size)
    pool.run(src, [1] * prefix)
    hit = PrefillPlan(f"hit{h}-{k}", prefix + suffix, (Chunk(prefix, prefix + suffix, group),),
                      cached_tokens=prefix, cached_instances=group,
                      cached_source=src.request_id).validate(pool.size)
    cold = PrefillPlan(f"cold{h}-{k}", suffix, (Chunk(0, suffix, group),)).validate(pool.size)
    out = {"holders": h, "cached": _timed(pool, hit, prefix + suffix),
           "cold": _timed(pool, cold, suffix),
           "sim_cached_chunk_s": float(profile.predict(h, prefix, suffix)),
           "sim_cold_chunk_s": float(profile.predict(h, 0, suffix))}
    for rid in (src.request_id, hit.request_id, cold.request_id):
        pool.release(rid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="paper-llama3-8b-emulated.toml")
    ap.add_argument("--holders", default="4,16")
    ap.add_argument("--prefix", type=int, default=64000)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import ray
    from tetris.actors.prefill.pool import PrefillPool

    from tetris.bench.fidelity_live import start_ray

    cfg = load_deployment(args.config)
    start_ray()
    pool = PrefillPool(cfg, timeout_s=120.0)
    profile = load_profile(cfg.scheduler.profile)
    rows = []
    try:
        for k in range(args.repeats):
            for h in [int(x) for x in args.holders.split(",")]:
                rows.append(profile_holders(pool, profile, h, args.prefix, args.suffix, k))
    finally:
        pool.shutdown()
        ray.shutdown()
    summary = {}
    for h in sorted({r["holders"] for r in rows}):
        mine = [r for r in rows if r["holders"] == h]
        med = {f"{kind}_{part}": statistics.median(r[kind][part] for r in mine)
               for kind in ("cached", "cold") for part in ("wall_s", "queued_s", "chunk_s",
                                                           "rest_s")}
        summary[h] = med | {"sim_cached_chunk_s": mine[0]["sim_cached_chunk_s"],
                            "sim_cold_chunk_s": mine[0]["sim_cold_chunk_s"]}
    if args.json:
        print(json.dumps({"label": "EMULATION", "args": vars(args), "rows": rows,
                          "summary": summary}))
        return
    print(f"EMULATION: emulated prefill pool alone, paper time; prefix {args.prefix}, suffix "
          f"{args.suffix} tokens; medians of {args.repeats}")
    print("| H | cached: wall / turn wait / chunk / rest (s) | SIM chunk | cold: wall / turn "
          "wait / chunk / rest (s) | SIM chunk |")
    print("| --- | --- | --- | --- | --- |")
    for h, m in summary.items():
        print(f"| {h} | {m['cached_wall_s']:.3f} / {m['cached_queued_s']:.3f} / "
              f"{m['cached_chunk_s']:.3f} / {m['cached_rest_s']:.3f} | "
              f"{m['sim_cached_chunk_s']:.3f} | {m['cold_wall_s']:.3f} / {m['cold_queued_s']:.3f}"
              f" / {m['cold_chunk_s']:.3f} / {m['cold_rest_s']:.3f} | "
              f"{m['sim_cold_chunk_s']:.3f} |")


if __name__ == "__main__":
    main()
