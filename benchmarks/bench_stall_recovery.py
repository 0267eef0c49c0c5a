"""How soon TTFT recovers after the prefill pool stalls, by what the policy plans on (SIMULATION).

A prefill worker that dies is replaced while the pool goes on (actors/prefill/worlds.py
``WorldKeeper.reform``); the requests whose tickets wait behind it hold up the instances they
were planned on. The dispatcher then plans on one of two views of the pool
(``Simulation(pool_view=...)``):

- ``bookings``: when the committed plans expected their chunks to end. Once those ends have
  passed they say "free now", though the pool still has the work queued; the policy then plans
  each new request as on an idle pool.
- ``report``: the pool's own answer to each commit (``PrefillPool.busy_for``, the tickets
  replayed from what runs now), which is what the live dispatcher plans on now.

Both runs see the same arrivals and the same stall (all instances out for ``--stall-s`` from
``--at``); a third run without the stall is the reference. Printed: mean TTFT per window, and
the recovery time, the end of the last window after the stall whose mean TTFT is more than
``--tolerance`` times the calm run's in the same window.

    python benchmarks/bench_stall_recovery.py
    python benchmarks/bench_stall_recovery.py --workload short --load 0.5 --plot stall.png --json
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from tetris.sim.experiments import RunSpec, run_one
from tetris.sim.prefill import Stall

# Tetris's simulated capacity (req/s) per workload on the 8B cluster (docs/simulation.md)
CAPACITY_8B = {"short": 7.05, "medium": 4.13, "long": 2.22}


def windows(sim, width: float, until: float) -> list[float]:
    """Mean TTFT of the requests arriving in each ``width``-second window up to ``until``."""
    arrival = np.array([r.arrival_time for r in sim.requests])
    out = []
    for a in np.arange(0.0, until, width):
        m = (arrival >= a) & (arrival < a + width)
        out.append(float(np.mean(sim.ttft[m])) if m.any() else float("nan"))
    return out


def recovery_s(stalled: list[float], calm: list[float], width: float, stall_end: float,
               tolerance: float) -> float:
    """Seconds from the stall's end to the end of the last window still above tolerance."""
    last = stall_end
    for k, (s, c) in enumerate(zip(stalled, calm)):
        start = k * width
        if start + width > stall_end and s > tolerance * c:
            last = max(last, start + width)
    return last - stall_end


def measure(workload: str, load: float, at: float, stall_s: float, seconds: float,
            width: float, tolerance: float, seed: int) -> dict:
    rate = load * CAPACITY_8B[workload]
    spec = RunSpec(model="8b", workload=workload, rate=rate, requests=int(rate * seconds),
                   seed=seed, decode=False)
    stall = [Stall(at, tuple(range(16)), stall_s)]
    _, calm = run_one(spec)
    calm_w = windows(calm, width, seconds)
    out = {"simulation": True, "workload": workload, "load": load, "rate_rps": rate,
           "stall": {"at_s": at, "seconds": stall_s, "instances": 16}, "window_s": width,
           "tolerance": tolerance, "seed": seed, "calm": calm_w, "views": {}}
    for view in ("bookings", "report"):
        _, sim = run_one(spec, stalls=stall, pool_view=view)
        w = windows(sim, width, seconds)
        out["views"][view] = {"windows": w,
                              "recovery_s": recovery_s(w, calm_w, width, at + stall_s, tolerance)}
    b, r = (out["views"][v]["recovery_s"] for v in ("bookings", "report"))
    out["recovery_ratio_bookings_over_report"] = b / r if r > 0 else float("inf")
    return out


def plot(out: dict, path: str) -> None:
    from tetris.sim.plots import save_figure   # sets the Agg backend first

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    x = [k * out["window_s"] for k in range(len(out["calm"]))]
    ax.step(x, out["calm"], where="post", color="0.6", label="no stall")
    for view, color in (("bookings", "tab:red"), ("report", "tab:blue")):
        v = out["views"][view]
        ax.step(x, v["windows"], where="post", color=color,
                label=f"plans on {view} (recovers in {v['recovery_s']:.0f} s)")
    st = out["stall"]
    ax.axvspan(st["at_s"], st["at_s"] + st["seconds"], color="0.9", label="stall")
    ax.set_yscale("log")
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel(f"mean TTFT per {out['window_s']:g} s window (s)")
    ax.set_title(f"8B cluster, {out['workload']} at {out['rate_rps']:.2f} req/s: all 16 prefill "
                 f"instances stalled {st['seconds']:g} s (SIMULATION)", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="short", choices=sorted(CAPACITY_8B))
    ap.add_argument("--load", type=float, default=0.5, help="share of Tetris's capacity (0.5)")
    ap.add_argument("--at", type=float, default=60.0, help="stall start, s (60)")
    ap.add_argument("--stall-s", type=float, default=20.0, help="stall length, s (20)")
    ap.add_argument("--seconds", type=float, default=300.0, help="arrivals over this long (300)")
    ap.add_argument("--window", type=float, default=15.0, help="window, s (15)")
    ap.add_argument("--tolerance", type=float, default=1.5,
                    help="a window has recovered within this factor of the calm run's (1.5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = measure(args.workload, args.load, args.at, args.stall_s, args.seconds, args.window,
                  args.tolerance, args.seed)
    if args.plot:
        plot(out, args.plot)
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out))
        return
    print(f"SIMULATION: 8B cluster, {args.workload} at {out['rate_rps']:.2f} req/s "
          f"(load {args.load:g}), all instances stalled {args.stall_s:g} s at {args.at:g} s")
    print("window  " + "".join(f"{k * args.window:>7.0f}" for k in range(len(out["calm"]))))
    print("calm    " + "".join(f"{v:7.2f}" for v in out["calm"]))
    for view, v in out["views"].items():
        print(f"{view:8s}" + "".join(f"{x:7.2f}" for x in v["windows"]))
    for view, v in out["views"].items():
        print(f"recovery, planning on {view}: {v['recovery_s']:.0f} s after the stall")
    print(f"ratio bookings / report: {out['recovery_ratio_bookings_over_report']:.2f}x")


if __name__ == "__main__":
    main()
