"""SIMULATION: per-chunk layouts with and without priced micro-partitions (#26 items 3-4).

The simulated A100 cluster of ``bench_sp_layouts_sim.py`` (16 TP-1 prefill instances on 2 nodes
of 8, LLaMA3-8B) runs the Long workload under ``tetris`` with each ``[sp_layout]`` twice, side by
side on the same seeded trace: as given (``micro_partitions = [1]``, the shipped behaviour) and
with ``micro_partitions = [1, 2, 4, 8]``, where the chooser may also put a chunk on ``ring/M`` or
``a2a/M`` (tetris/scheduler/sp_pipeline.py). A chunk runs ``T_s(h, l) + Δ`` on the simulated
hardware, the delta its plan predicted, so the simulation shows what the cost model's choice
is worth under the model itself, not a measurement of pipelining. ``--inter-node-gbps`` lowers
the NIC (the shipped 25 GB/s hides most ring transfers behind A100 attention).

    OMP_NUM_THREADS=1 python benchmarks/bench_sp_pipeline_sim.py [--seeds 0] [--rates 0.5,1.0]
        [--inter-node-gbps 25,5] [--requests 300]

Prints per configuration and rate the TTFT P50/P99 (seed means) of both runs, their ratio
(pieces / none), and the share of chunks on each layout/M.
"""

from __future__ import annotations

import argparse
import collections
import time

import msgspec

from tetris.config import SpLayoutConfig
from tetris.sim.experiments import RunSpec, run_one
from tetris.sim.prefill import PrefillPoolSim

LAYOUTS = {"ring": ("ring",), "ring|a2a": ("ring", "a2a")}
PIECES = (1, 2, 4, 8)


def chunk_kinds(spec: RunSpec) -> tuple[collections.Counter, object]:
    """The run's TTFT summary and the (layout/M) of every chunk the simulated pool executed."""
    seen: collections.Counter = collections.Counter()
    original = PrefillPoolSim.execute

    def counting(self, plan, arrival):
        seen.update(f"{c.sp_layout}/{c.sp_micro_partitions}" if c.sp_micro_partitions > 1
                    else c.sp_layout for c in plan.chunks if c.sp_size > 1)
        return original(self, plan, arrival)

    PrefillPoolSim.execute = counting
    try:
        result = run_one(spec)[0]
    finally:
        PrefillPoolSim.execute = original
    return seen, result.ttft


def _cell(base: RunSpec, seeds, rate) -> tuple[float, float, collections.Counter]:
    kinds: collections.Counter = collections.Counter()
    p50 = p99 = 0.0
    for s in seeds:
        seen, ttft = chunk_kinds(msgspec.structs.replace(base, rate=rate, seed=s))
        kinds.update(seen)
        p50 += ttft.p50 / len(seeds)
        p99 += ttft.p99 / len(seeds)
    return p50, p99, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="long")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--rates", default="0.5,1.0")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--inter-node-gbps", default="25,5")
    ap.add_argument("--ring-overlap", choices=("true", "false"), default="true")
    args = ap.parse_args()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    print(f"SIMULATION, 8B cluster, {args.workload}, tetris (online θ), {args.requests} requests, "
          f"seeds {list(seeds)}, ring_overlap {args.ring_overlap}; pieces = micro_partitions "
          f"{list(PIECES)} against [1], same trace")
    for gbps in (float(x) for x in args.inter_node_gbps.split(",")):
        for name, layouts in LAYOUTS.items():
            t0 = time.perf_counter()
            cfg = SpLayoutConfig(layouts=layouts, inter_node_gbps=gbps,
                                 ring_overlap=args.ring_overlap == "true")
            for rate in (float(r) for r in args.rates.split(",")):
                row = []
                for micro in ((1,), PIECES):
                    base = RunSpec(model="8b", workload=args.workload, policy="tetris",
                                   requests=args.requests,
                                   sp_layout=msgspec.structs.replace(cfg, micro_partitions=micro))
                    row.append(_cell(base, seeds, rate))
                (a50, a99, _), (b50, b99, kinds) = row
                total = sum(kinds.values()) or 1
                share = ", ".join(f"{k} {n / total:.0%}" for k, n in sorted(kinds.items()))
                print(f"{gbps:g} GB/s {name} @ {rate:g} req/s: none P50 {a50:.3f} s P99 {a99:.3f} s;"
                      f" pieces P50 {b50:.3f} s P99 {b99:.3f} s; ratio P50 x{b50 / a50:.3f} "
                      f"P99 x{b99 / a99:.3f}; SP>1 chunks with pieces: {share} "
                      f"[{time.perf_counter() - t0:.0f} s]")


if __name__ == "__main__":
    main()
