"""SIMULATION: Tetris with per-chunk SP layout choice vs the ring only, on the paper's 8B cluster.

The simulated A100 cluster (16 TP-1 prefill instances on 2 nodes of 8, LLaMA3-8B: 8 KV heads)
runs the Long workload under the ``tetris`` policy (online θ) with each ``SpLayoutConfig``:
the ring only (the default), ring or SP-NTP all-to-all per chunk by the CSPS Appendix A model
with ring transfers hidden behind attention (the model as shipped), ring or SP-TP, and the
three layouts; SP-NTP and SP-TP on SP 16 replicate the 8 KV heads; and the same with the
ring's transfers charged in full (``ring_overlap = False``: an upper bound on what all-to-all
saves). A chunk on all-to-all runs ``T_s(h, l) + Δ`` on the simulated hardware, the delta the
plan predicted. ``a2a forced`` / ``sptp forced`` put every chunk of SP > 1 on SP-NTP / SP-TP
where it can run (the ring elsewhere), charged their modelled time: SP-NTP against SP-TP with
the chooser out of the way. Per configuration: capacity (the simulator's bisection against the SLO of
``tetris.sim.experiments.capacity``), TTFT P50/P99 at fixed rates, and the share of chunks on
each layout and SP size.

    OMP_NUM_THREADS=1 python benchmarks/bench_sp_layouts_sim.py [--seeds 0,1,2]
        [--tail 1000000 --tail-every 50]

``--tail`` replaces every ``--tail-every``-th prompt by a ``--tail``-token one (the 1M-token
tail of ``benchmarks/bench_elastic_decode.py``, ``tetris.sim.elastic_runs.with_tail``); the
light-load reference of the capacity SLO is then taken over the same tailed workload.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import time

from tetris.config import SpLayoutConfig
from tetris.scheduler.sp_comm import LayoutChoice, LayoutChooser
from tetris.sim.experiments import RunSpec, capacity, light_load, run_one
from tetris.sim.prefill import PrefillPoolSim

CONFIGS = {
    "ring only": SpLayoutConfig(),
    "ring|a2a": SpLayoutConfig(layouts=("ring", "a2a")),
    "ring|a2a, ring charged in full": SpLayoutConfig(layouts=("ring", "a2a"), ring_overlap=False),
    "ring|sptp": SpLayoutConfig(layouts=("ring", "sptp")),
    "ring|sptp, ring charged in full": SpLayoutConfig(layouts=("ring", "sptp"), ring_overlap=False),
    "ring|a2a|sptp, ring charged in full": SpLayoutConfig(layouts=("ring", "a2a", "sptp"),
                                                          ring_overlap=False),
    # Every chunk of SP > 1 on one layout where it can run (ring otherwise): SP-NTP vs SP-TP
    # throughput with the chooser out of the way (CSPS Fig. 12's comparison, on TP-1 members).
    "a2a forced": SpLayoutConfig(layouts=("ring", "a2a", "sptp"), ring_overlap=False),
    "sptp forced": SpLayoutConfig(layouts=("ring", "a2a", "sptp"), ring_overlap=False),
}
FORCED = {"a2a forced": "a2a", "sptp forced": "sptp"}


@contextlib.contextmanager
def forced_layout(layout: str | None):
    """``LayoutChooser.choose`` picking ``layout`` for every chunk of SP > 1 it can run on, the
    plan charged its modelled time (delta against the ring, as the chooser charges a pick)."""
    if layout is None:
        yield
        return
    original = LayoutChooser.choose

    def choose(self, members, node_of, history, tokens, attention_s=0.0):
        pick = original(self, members, node_of, history, tokens, attention_s)
        if len(members) < 2 or self.feasible(layout, len(members)):
            return LayoutChoice("ring", pick.reason + "; forced: ring", 0.0, pick.times)
        t = pick.times
        return LayoutChoice(layout, pick.reason + f"; forced: {layout}", t[layout] - t["ring"], t)

    LayoutChooser.choose = choose
    try:
        yield
    finally:
        LayoutChooser.choose = original


def chunk_layouts(spec: RunSpec) -> collections.Counter:
    """(layout, SP size) of every chunk the simulated pool executed in one run."""
    seen: collections.Counter = collections.Counter()
    original = PrefillPoolSim.execute

    def counting(self, plan, arrival):
        seen.update((c.sp_layout, c.sp_size) for c in plan.chunks)
        return original(self, plan, arrival)

    PrefillPoolSim.execute = counting
    try:
        run_one(spec)
    finally:
        PrefillPoolSim.execute = original
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="long")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rates", default="0.5,1.0")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--tail", type=int, default=0,
                    help="tokens of the tail prompts (0: no tail)")
    ap.add_argument("--tail-every", type=int, default=50)
    ap.add_argument("--capacity-lo", type=float, default=0.25,
                    help="the bisection's lowest rate (must be sustainable)")
    ap.add_argument("--capacity-tol", type=float, default=0.05,
                    help="the bisection's resolution in req/s")
    ap.add_argument("--configs", default=";".join(CONFIGS),
                    help="which configurations, by name, separated by ; (default all)")
    args = ap.parse_args()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    rates = [float(r) for r in args.rates.split(",")]
    tail = {"tail_every": args.tail_every, "tail_tokens": args.tail} if args.tail else {}
    light = light_load("8b", args.workload, **tail)
    label = args.workload + (f" + every {args.tail_every}th prompt {args.tail} tokens" if tail else "")
    print(f"SIMULATION, 8B cluster, {label}, tetris (online θ), {args.requests} requests, "
          f"seeds {list(seeds)}; light-load TTFT P50 {light[0]:.3f} s P99 {light[1]:.3f} s")
    for name in args.configs.split(";"):
        cfg = CONFIGS[name]
        t0 = time.perf_counter()
        base = RunSpec(model="8b", workload=args.workload, policy="tetris",
                       requests=args.requests, sp_layout=cfg, **tail)
        with forced_layout(FORCED.get(name)):
            cap = capacity(base, seeds, lo=args.capacity_lo, tol=args.capacity_tol, light=light)
            cells = []
            for rate in rates:
                ttft = [run_one(RunSpec(**{**_fields(base), "rate": rate, "seed": s}))[0].ttft
                        for s in seeds]
                p50 = sum(t.p50 for t in ttft) / len(ttft)
                p99 = sum(t.p99 for t in ttft) / len(ttft)
                cells.append(f"{rate:g} req/s: P50 {p50:.4f} s, P99 {p99:.4f} s")
            layouts = chunk_layouts(RunSpec(**{**_fields(base), "rate": rates[0],
                                               "seed": seeds[0]}))
        total = sum(layouts.values())
        share = ", ".join(f"{lay} SP{sp} {n / total:.0%}" for (lay, sp), n in sorted(layouts.items()))
        print(f"{name}: capacity {cap.capacity_rps:.3f} req/s; " + "; ".join(cells)
              + f" (seed means); chunks at {rates[0]:g} req/s: {share} "
              f"[{time.perf_counter() - t0:.0f} s]")


def _fields(spec: RunSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


if __name__ == "__main__":
    main()
