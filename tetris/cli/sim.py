"""``tetris sim``: the discrete-event simulator (run, sweep, capacity, profile-rate, figures).

Every subcommand takes ``--json`` (print exactly one JSON object) and otherwise shows a
progress bar on stderr and a short table on stdout. Nothing here imports torch or ray.
"""

from __future__ import annotations

import argparse
import json
import sys

from tetris.cli.args import positive_list

__all__ = ["register"]


def _theta(text: str) -> float | None:
    if text == "online":
        return None
    v = float(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError("improvement rate must be in [0, 1) or 'online'")
    return v


_rates = positive_list(float, "rates")
_thetas = positive_list(float, "improvement rates")
ALL_POLICIES = "tetris,fixed-sp-8,fixed-sp-16,loongserve-disagg,loongserve"


def _output_mean(text: str) -> float:
    v = float(text)
    if not 32.0 < v < float("inf"):
        raise argparse.ArgumentTypeError("output mean must exceed 32 tokens")
    return v


def _common(p: argparse.ArgumentParser, requests: int) -> None:
    p.add_argument("--model", choices=["8b", "70b"], default="8b")
    p.add_argument("--workload", default="short", help="short | medium | long | trace file (CSV/JSONL)")
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="directory for PNGs, tables and traces")
    p.add_argument("--improvement-rate", type=_theta, default=None,
                   help="θ for tetris policies: a number, or 'online' (rate table, default)")
    p.add_argument("--rate-table", default=None, help="improvement-rate table file")
    p.add_argument("--no-decode", action="store_true", help="simulate prefill only")
    p.add_argument("--execution", choices=["profile", "measured"], default="profile",
                   help="chunk times on the simulated hardware: the scheduler's fitted profile "
                        "(default; execution equals the plan) or the profile's measurements "
                        "(8B: Table 1), which the scheduler does not see")


def _output_mean_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-mean", type=_output_mean, default=384.0, metavar="TOKENS",
                   help="mean output tokens of named workloads (default 384, range [32, 2048]; "
                        "above 384 the maximum scales by mean/384)")


def register(subparsers) -> None:
    sim = subparsers.add_parser("sim", help="discrete-event simulation of the cluster")
    sub = sim.add_subparsers(dest="sim_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser("run", help="one run of one policy at one rate")
    _common(p, 1000)
    _output_mean_arg(p)
    p.add_argument("--policy", default="tetris")
    p.add_argument("--rate", type=float, default=2.0)
    p.set_defaults(func=_user_errors(_run))
    p = sub.add_parser("sweep", help="TTFT P50/P99 against rate per policy (Fig. 8)")
    _common(p, 1000)
    _output_mean_arg(p)
    p.add_argument("--policy", default=ALL_POLICIES)
    p.add_argument("--rates", type=_rates, default=_rates("1,2,3,4,5,6"))
    p.add_argument("--seeds", type=int, default=1)
    p.set_defaults(func=_user_errors(_sweep))
    p = sub.add_parser("capacity", help="highest rate under the 25x light-load criterion")
    _common(p, 1000)
    _output_mean_arg(p)
    p.add_argument("--policy", default=ALL_POLICIES)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--tol", type=float, default=0.05)
    p.set_defaults(func=_user_errors(_capacity))
    p = sub.add_parser("profile-rate", help="build the improvement-rate table of a workload")
    _output_mean_arg(p)
    _common(p, 500)
    p.add_argument("--rates", type=_rates, default=None, help="default: 0.5 req/s steps")
    p.add_argument("--thetas", type=_thetas, default=None)
    p.add_argument("--seeds", type=int, default=3)
    p.set_defaults(func=_user_errors(_profile))
    p = sub.add_parser("figures", help="reproduce Figs. 8, 9, 11-13 and the capacity table")
    _output_mean_arg(p)
    _common(p, 1000)
    p.add_argument("--workloads", default="short,medium,long")
    p.add_argument("--seeds", type=int, default=1)
    p.set_defaults(func=_user_errors(_figures))


def _user_errors(func):
    """A bad argument (unknown policy or workload, missing trace or table, a profile without
    measurements, ...) raises ValueError deep in the simulator: say it in one line, exit 2."""
    def run(args) -> int:
        try:
            return func(args)
        except ValueError as e:
            print(f"tetris sim {args.sim_command}: error: {e}", file=sys.stderr)
            return 2
    return run


def _spec(args, **kw):
    from tetris.sim.experiments import RunSpec
    return RunSpec(model=args.model, workload=args.workload, requests=args.requests,
                   seed=args.seed, improvement_rate=args.improvement_rate,
                   rate_table=args.rate_table, decode=not args.no_decode,
                   output_mean=args.output_mean, execution=args.execution, **kw)


def _bar(args, total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=args.json, file=sys.stderr)


def _emit(args, obj: dict, lines: list[str]) -> int:
    if args.json:
        print(json.dumps(obj, default=float))
    else:
        print("\n".join(lines))
    return 0


def _run(args) -> int:
    from pathlib import Path

    from tetris.sim.experiments import run_one
    spec = _spec(args, policy=args.policy, rate=args.rate, record=args.out is not None)
    res, sim = run_one(spec)
    out = res.brief()
    out["execution"] = args.execution
    if args.out:
        from tetris.sim.plots import plot_schedule
        from tetris.sim.trace_export import write_chrome_trace
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        n = len(sim.prefill.free_at)
        out["chrome_trace"] = str(write_chrome_trace(d / "trace.json", sim.prefill.runs, sim.decode_reqs, n))
        runs = sim.prefill.runs
        mid = runs[len(runs) // 2].start
        out["schedule_png"] = str(plot_schedule(runs, n, d / "schedule.png", mid, mid + 20.0,
                                                f"{res.policy}, {res.workload}, {res.rate} req/s"))
    t = res.ttft
    lines = [f"{res.policy} {res.model} {res.workload} @ {res.rate} req/s, {res.requests} requests",
             f"TTFT mean {t.mean:.3f}s  P50 {t.p50:.3f}s  P90 {t.p90:.3f}s  P99 {t.p99:.3f}s"]
    if res.refused:
        lines.append(f"refused {res.refused} of {res.requests} requests: larger than a decode "
                     f"instance's KV (the live system's 429)")
    if res.tbt is not None:
        lines.append(f"TBT  P50 {res.tbt.p50 * 1e3:.1f}ms  P99 {res.tbt.p99 * 1e3:.1f}ms  "
                     f"throughput {res.throughput_rps:.2f} req/s")
    lines.append(f"prefill utilisation {res.prefill_utilisation:.2f}, chunks/request "
                 f"{res.mean_chunks:.2f}, mean SP {res.mean_sp:.2f}, θ {res.improvement_rates[:8]}")
    if args.execution != "profile":
        lines.append(f"{args.execution} execution: plans missed by up to "
                     f"{res.max_plan_deviation_s:.3f}s")
    lines.append(f"simulated {res.sim_requests_per_s:.0f} requests/s of wall time")
    return _emit(args, out, lines)


def _sweep(args) -> int:
    from tetris.sim.experiments import sweep
    policies = args.policy.split(",")
    with _bar(args, len(policies) * len(args.rates), "sweep") as bar:
        rows = sweep(_spec(args), policies, args.rates, range(args.seed, args.seed + args.seeds), bar)
    for r in rows:
        r.pop("_ttfts")
    if args.out:
        from tetris.sim.experiments import light_load
        from tetris.sim.plots import plot_ttft_vs_rate
        plot_ttft_vs_rate(rows, f"{args.out}/ttft_vs_rate.png",
                          light_load(args.model, args.workload, execution=args.execution))
    lines = [f"{'policy':22s} {'rate':>5s} {'P50':>8s} {'P99':>8s}"] + [
        f"{r['policy']:22s} {r['rate']:5.2f} {r['ttft_p50']:8.3f} {r['ttft_p99']:8.3f}" for r in rows]
    return _emit(args, {"model": args.model, "workload": args.workload, "rows": rows}, lines)


def _capacity(args) -> int:
    import msgspec

    from tetris.sim.experiments import capacity, light_load
    light = light_load(args.model, args.workload, execution=args.execution)
    caps = []
    with _bar(args, len(args.policy.split(",")), "capacity") as bar:
        for policy in args.policy.split(","):
            caps.append(capacity(_spec(args, policy=policy), range(args.seed, args.seed + args.seeds),
                                 tol=args.tol, light=light))
            bar.update(1)
    lines = [f"light load P50 {light[0]:.3f}s P99 {light[1]:.3f}s; SLO 25x"] + [
        f"{c.policy:22s} capacity {c.capacity_rps:.2f} req/s" for c in caps]
    return _emit(args, {"model": args.model, "workload": args.workload,
                        "execution": args.execution, "capacities": msgspec.to_builtins(caps)},
                 lines)


def _profile(args) -> int:
    from tetris.sim.experiments import rate_table_path
    from tetris.sim.profiler import DEFAULT_THETAS, default_rate_grid, profile_rates, save_table
    if args.execution != "profile" and not args.rate_table:
        # The shipped tables are the deployable ones: profiled on the fit, the only hardware
        # model a deployed profiler has. One profiled on the measurements is an oracle's.
        raise ValueError("profiling on --execution measured needs --rate-table PATH (it must not "
                         "replace the shipped table, which is profiled on the fit)")
    rates = args.rates or default_rate_grid(args.model, args.workload)
    thetas = args.thetas or list(DEFAULT_THETAS)
    with _bar(args, len(rates) * len(thetas), "profile-rate") as bar:
        rates, best, grid = profile_rates(args.model, args.workload, rates, thetas, args.seeds,
                                          args.requests, bar, args.output_mean, args.execution)
    path = save_table(args.rate_table or rate_table_path(args.model, args.workload), rates, best,
                      model=args.model, workload=args.workload)
    lines = [f"wrote {path}"] + [f"{r:5.2f} req/s -> θ {t:.2f}" for r, t in zip(rates, best)]
    return _emit(args, {"path": str(path), "rates": rates, "improvement_rates": best, "grid": grid},
                 lines)


def _figures(args) -> int:
    from tetris.sim.figures import reproduce
    return _emit(args, *reproduce(args))
