"""KunServe against the KV-centric baselines on a BurstGPT-like burst: SIMULATION, and with
``--emulated`` the EMULATION of the same trace side by side.

    python benchmarks/bench_kunserve.py [--profile qwen2.5-14b-tp1] [--requests 10000]
        [--rate 150] [--burst 0.3,0.7,2] [--seed 1] [--round-model lookahead|token_budget|fixed]
        [--lengths burstgpt|sharegpt|longbench] [--emulated --policies kunserve,swap --jobs 2]
        [--out FILE.json]

Every policy runs the same seeded trace (by default the rate doubles for the middle 40% of the
requests; ``--burst first,end,factor`` shapes another) on
the same deployment profile (configs/kunserve-<profile>.toml); one table, ratios side by side.
Beside the table: the trace's KV *demand* (what every arrived, unfinished request would hold
with unlimited memory, as a share of the pool's KV; KunServe's evaluation keeps its time
average under 60%, §6), the trace's decode load by arrival phase (``rho``: the share of the
pool's decode throughput it asks for, ``tetris/sim/kunserve_load.py``), P50 TPOT by arrival
phase (before, in, after the burst), and the *no-queue reference*: the same pool with
unlimited KV and no batch cap, where nothing waits, whose TPOT is what serving the trace
without queueing costs (KunServe's TPOT is compared against it as well as the baselines).
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np

from tetris.bench.kunserve_compare import _trace, compare, deployment
from tetris.sim.kunserve import POLICIES, ROUND_MODELS, KunServeSim
from tetris.sim.kunserve_load import no_queue_sim, phase_loads
from tetris.sim.kunserve_workload import LENGTHS


def kv_demand(profile: str, requests: int, rate: float, seed: int, burst,
              lengths: str = "burstgpt") -> dict:
    """Time average (over the arrivals) and peak of the trace's KV demand / the pool's KV,
    from the no-queue reference (``no_queue_sim``: 20x the KV, no batch cap, nothing waits
    for memory), and that run's result (its TPOT: serving the trace without queueing)."""
    mem, prof = deployment(profile)
    pool = prof.instances * mem.kv_blocks
    sim = no_queue_sim(_trace(requests, rate, seed, burst, lengths), mem, prof)
    log: list[tuple[float, int]] = []
    start = sim._start

    def logged(now, unit):
        log.append((now, sum(u.used for u in sim.units)))
        start(now, unit)
    sim._start = logged
    result = sim.run()
    result["mode"] = "SIMULATION"
    last = sim.reqs[-1].arrival
    t = np.array([a for a, _ in log if a <= last] + [last])
    d = np.array([b for a, b in log if a <= last]) / pool
    return {"mean": float(np.sum(np.diff(t) * d) / last),
            "peak": float(max(b for _, b in log) / pool),
            "no_queue": result}


def _by_phase(reqs, burst) -> list[float]:
    n = len(reqs)
    cuts = (0, int(burst[0] * n), int(burst[1] * n), n)
    return [float(np.median([(r.finish - r.first_token) / (r.output - 1)
                             for r in reqs[a:b] if r.output > 1])) * 1e3
            for a, b in itertools.pairwise(cuts)]


def phase_tpot(profile: str, requests: int, rate: float, seed: int, round_model: str,
               burst, lengths: str = "burstgpt") -> dict:
    """P50 TPOT (ms) of each policy's requests, and the no-queue reference's, by arrival
    phase: before, in, after the burst."""
    mem, prof = deployment(profile)
    out = {}
    for policy in POLICIES:
        reqs = _trace(requests, rate, seed, burst, lengths)
        KunServeSim(reqs, mem, prof, policy, round_model=round_model).run()
        out[policy] = _by_phase(reqs, burst)
    reqs = _trace(requests, rate, seed, burst, lengths)
    no_queue_sim(reqs, mem, prof).run()
    out["no-queue"] = _by_phase(reqs, burst)
    return out


def _table(out: dict) -> None:
    if "kv_demand" in out:     # the no-queue reference as one more SIMULATION row
        out = {**out, "SIMULATION": {**out["SIMULATION"],
                                     "no-queue": out["kv_demand"]["no_queue"]}}
    print(f"{'mode':<10} {'policy':<10} {'P50 TTFT':>9} {'P99 TTFT':>9} {'P99/Kun':>8} "
          f"{'P50 TPOT':>9} {'Kun/this':>9} {'P99 TPOT':>9} {'preempt':>8} {'pre-drop':>8} "
          f"{'drops':>6} {'restores':>8} {'exch GB':>8} {'unfin':>6}")
    for mode in ("SIMULATION", "EMULATION"):
        rows = out.get(mode, {})
        k = rows.get("kunserve")
        for policy, r in rows.items():
            vs = (f"{r['p99_ttft'] / k['p99_ttft']:>7.1f}x", f"{k['p50_tpot'] / r['p50_tpot']:>8.3f}x") \
                if k else ("-", "-")
            print(f"{mode:<10} {policy:<10} {r['p50_ttft']:>9.3f} {r['p99_ttft']:>9.3f} {vs[0]:>8} "
                  f"{r['p50_tpot'] * 1e3:>7.1f}ms {vs[1]:>9} {r['p99_tpot'] * 1e3:>7.1f}ms "
                  f"{r['preemptions']:>8} {r['preemptions_before_first_regroup']:>8} "
                  f"{r['drops']:>6} {r['restores']:>8} {r['exchange_gb']:>8.1f} "
                  f"{r['unfinished']:>6}")
    for policy, e in out.get("EMULATION", {}).items():
        s = out["SIMULATION"][policy]
        print(f"live/sim {policy:<10} P99 TTFT {e['p99_ttft'] / s['p99_ttft']:.3f}  "
              f"P50 TPOT {e['p50_tpot'] / s['p50_tpot']:.3f}  most behind its timeline "
              f"{e['max_lag_s']:.3f} s  regroups decided at "
              f"SIMULATION {s['regroup_s']} EMULATION {e['regroup_s']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="qwen2.5-14b-tp1")
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--rate", type=float, default=150.0, help="base arrivals/s")
    ap.add_argument("--burst", default="0.3,0.7,2",
                    help="first,end request of the burst (shares of the trace),rate factor")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lengths", default="burstgpt", choices=sorted(LENGTHS),
                    help="request lengths drawn around this dataset's means")
    ap.add_argument("--round-model", default="lookahead", choices=ROUND_MODELS)
    ap.add_argument("--emulated", action="store_true", help="also run the EMULATION")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--jobs", type=int, default=2, help="emulated policies at once")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="EMULATION: slow emulated time by this factor (a loaded machine)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--no-demand", action="store_true",
                    help="skip the KV demand and the TPOT by phase (five more SIMULATIONs)")
    args = ap.parse_args()
    policies = tuple(p for p in args.policies.split(",") if p)
    burst = tuple(float(x) for x in args.burst.split(","))
    out = compare(profile=args.profile, requests=args.requests, rate=args.rate, seed=args.seed,
                  jobs=args.jobs, emulate=args.emulated, policies=policies,
                  time_scale=args.time_scale,
                  round_model=args.round_model, burst=burst, lengths=args.lengths)
    if not args.no_demand:
        out["kv_demand"] = kv_demand(args.profile, args.requests, args.rate, args.seed, burst,
                                     args.lengths)
        out["p50_tpot_ms_by_phase"] = phase_tpot(args.profile, args.requests, args.rate,
                                                 args.seed, args.round_model, burst,
                                                 args.lengths)
    print(f"SIMULATION{' and EMULATION' if args.emulated else ''}  profile={out['profile']}  "
          f"instances={out['instances']}  kv_blocks={out['kv_blocks']} per instance  "
          f"requests={args.requests}  rate={args.rate:g}/s -> {burst[2] * args.rate:g}/s for "
          f"requests {burst[0]:g}-{burst[1]:g} of the trace  "
          f"seed={args.seed}  lengths={args.lengths}  round model={args.round_model}")
    mem, prof = deployment(args.profile)
    out["decode_load_by_phase"] = phase_loads(
        _trace(args.requests, args.rate, args.seed, burst, args.lengths), mem, prof, burst[:2])
    print("decode load rho before / in / after the burst: "
          + " / ".join(f"{x:.2f}" for x in out["decode_load_by_phase"]))
    if not args.no_demand:
        d = out["kv_demand"]
        print(f"KV demand / pool KV: time average {d['mean']:.2f}, peak {d['peak']:.2f}")
    _table(out)
    if not args.no_demand:
        print("P50 TPOT ms by arrival phase (before / in / after the burst): " + "; ".join(
            f"{p} {' / '.join(f'{x:.1f}' for x in v)}"
            for p, v in out["p50_tpot_ms_by_phase"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
