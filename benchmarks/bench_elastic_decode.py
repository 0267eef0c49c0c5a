"""Elastic decode vs whole-request decode placement, side by side in one run.

    python benchmarks/bench_elastic_decode.py [--requests 1000] [--every 50] [--tail 1000000]
        [--models 8b 70b] [--cluster-rate 0.5] [--cpu-steps 20] [--json]

1. SIMULATION, decode side alone (tetris/sim/elastic_runs.py): the paper cluster's decode
   instances (8b: 2 x TP-8, 70b: 8 x TP-4; A100 decode latency model), the Long workload with
   every ``--every``-th prompt replaced by a ``--tail``-token one, each request's KV handed
   off at its arrival. Maximum sustainable load: the highest Poisson rate at which no request
   is refused and the P99 wait for room (hand-off to admission) is within 2 s, by bisection.
   Then P99 TBT and output tokens/s per GPU of both placements at the same rates.
2. SIMULATION, the whole cluster (the A100 Table 1 profile for 8b): TTFT and TBT of both at
   ``--cluster-rate`` (the prefill side included).
3. CPU, in process (tetris/engine/sharded_decode.py on the seeded tiny model): time of one
   decode step of a request whose KV is on 1, 2 and 3 holders, beside two unsplit requests.
   The holders run one after another here, so the ratio is the mechanism's overhead (extra
   partial attention calls, messages, LSE merges), not a parallel speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec

from tetris.control.elastic import ElasticConfig
from tetris.sim.elastic_runs import (
    decode_capacity,
    run_decode_side,
    run_elastic,
    with_tail,
)
from tetris.sim.experiments import RunSpec, make_requests

WHOLE = ElasticConfig(enabled=False)
ELASTIC = ElasticConfig(enabled=True)


def _decode_side(model: str, args) -> dict:
    kw = {"n": args.requests, "seed": args.seed, "every": args.every, "tail_tokens": args.tail}
    caps = {}
    for name, cfg in (("whole", WHOLE), ("elastic", ELASTIC)):
        rate, _, probes = decode_capacity(model, "long", cfg, tol=args.tol, **kw)
        caps[name] = {"capacity_rps": rate, "probes": probes}
    # whole placement's limit on the requests it can serve at all (the tail refused)
    rate, _, probes = decode_capacity(model, "long", WHOLE, tol=args.tol, allow_refused=True, **kw)
    caps["whole_refusing_tail"] = {"capacity_rps": rate, "probes": probes}
    top = max(c["capacity_rps"] for c in caps.values())
    rates = sorted({round(f * top, 2) for f in (0.25, 0.5, 0.9)} - {0.0})
    rows = []
    for rate in rates:
        reqs = with_tail(make_requests("long", rate, args.requests, args.seed), args.every,
                         args.tail)
        row = {"rate": rate}
        for name, cfg in (("whole", WHOLE), ("elastic", ELASTIC)):
            res = run_decode_side(reqs, model, cfg, rate)
            row[name] = msgspec.to_builtins(res)
        rows.append(row)
    return {"capacity": caps, "rows": rows}


def _cluster(args) -> dict:
    spec = RunSpec(model="8b", workload="long", rate=args.cluster_rate,
                   requests=args.cluster_requests, improvement_rate=0.3, seed=args.seed)
    reqs = with_tail(make_requests("long", spec.rate, spec.requests, spec.seed), args.every,
                     args.tail)
    out = {}
    for name, cfg in (("whole", WHOLE), ("elastic", ELASTIC)):
        res, sim = run_elastic(spec, cfg, reqs)
        out[name] = {"ttft_p50": res.ttft.p50, "ttft_p99": res.ttft.p99,
                     "tbt_p50": res.tbt.p50, "tbt_p99": res.tbt.p99,
                     "sharded": sum(bool(r.remote) for r in sim.decode_reqs if r is not None)}
    return out


def _cpu(args) -> dict:
    import sys
    from pathlib import Path

    import torch

    from tetris.engine.kv_shards import ShardHolder
    from tetris.engine.sharded_decode import ShardedDecoder

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
    from engine_helpers import tiny_model

    model, _ = tiny_model()
    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(0, 256, (198,), generator=gen).tolist()
    short = [torch.randint(0, 256, (16,), generator=gen).tolist() for _ in range(2)]
    splits = {1: [(0, 0, 198)], 2: [(0, 0, 99), (1, 99, 198)],
              3: [(0, 0, 66), (1, 66, 132), (2, 132, 198)]}
    times = {k: [] for k in splits}
    decoders = {}
    for k, ranges in splits.items():
        dec = ShardedDecoder(model, [ShardHolder(i, model, 128, 16) for i in range(3)])
        dec.place_prefilled("long", long_prompt, ranges, args.cpu_steps + 1)
        dec.place_prefilled("s0", short[0], [(0, 0, 16)], args.cpu_steps + 1)
        dec.place_prefilled("s1", short[1], [(1, 0, 16)], args.cpu_steps + 1)
        decoders[k] = dec
    for _ in range(args.cpu_steps):      # interleaved: the same machine state for each split
        for k, dec in decoders.items():
            start = time.perf_counter()
            dec.step()
            times[k].append(time.perf_counter() - start)
    tokens = {k: d.requests["long"].output_token_ids for k, d in decoders.items()}
    assert tokens[2] == tokens[1] and tokens[3] == tokens[1], "a split changed the tokens"
    base = statistics.median(times[1])
    return {str(k): {"step_ms": statistics.median(t) * 1e3,
                     "ratio": statistics.median(t) / base} for k, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--tail", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=0.1)
    p.add_argument("--models", nargs="+", default=["8b", "70b"])
    p.add_argument("--cluster-rate", type=float, default=0.5)
    p.add_argument("--cluster-requests", type=int, default=300)
    p.add_argument("--cpu-steps", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = {m: _decode_side(m, args) for m in args.models}
    result["cluster_8b"] = _cluster(args)
    result["cpu"] = _cpu(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for m in args.models:
        caps = result[m]["capacity"]
        print(f"SIMULATION {m} decode side, Long + every {args.every}th prompt {args.tail} tokens, "
              f"{args.requests} requests")
        print(f"  max sustainable rate: whole {caps['whole']['capacity_rps']:.2f} req/s "
              f"(refusing what fits no instance: "
              f"{caps['whole_refusing_tail']['capacity_rps']:.2f}), "
              f"elastic {caps['elastic']['capacity_rps']:.2f} req/s")
        print("  rate  | whole: TBT P50/P99 ms, wait P99 s, tok/s/GPU, refused | "
              "elastic: same, sharded, consolidated")
        for row in result[m]["rows"]:
            w, e = row["whole"], row["elastic"]
            print(f"  {row['rate']:5.2f} | {w['tbt_p50'] * 1e3:5.1f}/{w['tbt_p99'] * 1e3:5.1f} "
                  f"{w['wait_p99']:7.2f} {w['tokens_per_s_per_gpu']:6.1f} {w['refused']:3d} | "
                  f"{e['tbt_p50'] * 1e3:5.1f}/{e['tbt_p99'] * 1e3:5.1f} {e['wait_p99']:7.2f} "
                  f"{e['tokens_per_s_per_gpu']:6.1f} {e['sharded']:3d} {e['consolidations']:2d}")
    c = result["cluster_8b"]
    print(f"SIMULATION 8b whole cluster at {args.cluster_rate} req/s "
          f"({args.cluster_requests} requests, same tail):")
    for name in ("whole", "elastic"):
        r = c[name]
        print(f"  {name:7s} TTFT P50/P99 {r['ttft_p50']:.2f}/{r['ttft_p99']:.2f} s, "
              f"TBT P50/P99 {r['tbt_p50'] * 1e3:.1f}/{r['tbt_p99'] * 1e3:.1f} ms, "
              f"sharded {r['sharded']}")
    print("CPU in-process (tiny model, 198-token request + 2 unsplit): step ms / ratio to 1 holder")
    for k, r in result["cpu"].items():
        print(f"  {k} holder(s): {r['step_ms']:.2f} ms  x{r['ratio']:.2f}")


if __name__ == "__main__":
    main()
