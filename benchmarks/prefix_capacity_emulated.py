"""``bench_prefix_cache_emulated.py --capacity``: capacity of prefix caching, EMULATION beside
SIMULATION, and where a cached request's live TTFT goes against the simulated one.

One SLO for every setting and both halves: ``--slo-factor`` × the SIMULATION's TTFT P50 and
P99 of the uncached trace at 0.25 req/s (the capacity rule of ``tetris.sim.experiments``,
with a tighter factor: a trace of a few dozen requests meets 25× at any rate). Each half
searches the same rates by the same bisection (``prefix_experiments.bisect_capacity``):
SIMULATION with ``prefix_capacity``, EMULATION with ``live_capacity`` on one live app per
setting (the cache cleared between probes). Every live probe has the simulated TTFT of the same
trace beside it. The breakdown (probe at ``--rate``, cache on): per request, live
arrival -> planned -> first chunk's start -> prefill end against the simulator's arrival ->
chunk 0's start -> prefill end, paper seconds.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import msgspec
import numpy as np

from tetris.bench.fidelity_live import start_ray
from tetris.bench.prefix_live import live_capacity, live_cluster
from tetris.config import load_deployment
from tetris.sim.prefix_experiments import (
    default_capacity_blocks,
    prefix_capacity,
    run_prefix,
    slo_from_light_load,
)
from tetris.sim.prefix_workload import PrefixWorkload, shared_prefix_prompts


def _pct(xs, q: float) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_capacity(args) -> None:
    spec = PrefixWorkload(documents=args.documents, sessions=args.sessions)
    blocks = default_capacity_blocks("8b", spec.block_tokens)
    items = shared_prefix_prompts(spec, 1.0, args.seed)
    segments = {r.request_id: s for r, s in items}

    def trace_at(rate: float):
        return [msgspec.structs.replace(r, output_tokens=min(r.output_tokens, args.max_output))
                for r in (x for x, _ in shared_prefix_prompts(spec, rate, args.seed))]

    search = {"lo": args.lo, "hi": args.hi, "tol": args.tol, "max_rate": args.max_rate}
    slo = slo_from_light_load(spec, args.seed, 0.25, factor=args.slo_factor,
                              capacity_blocks=blocks)
    out = {"label": "EMULATION beside SIMULATION", "args": vars(args), "requests": len(items),
           "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r, _ in items])),
           "slo_p50_s": slo[0], "slo_p99_s": slo[1], "settings": {}}
    base = load_deployment(args.config)
    start_ray()
    with tempfile.TemporaryDirectory() as tmp:
        for cache in [c for c in (False, True) if args.only in ("", "on" if c else "off")]:
            sim_cap, sim_probes = prefix_capacity(spec, args.seed, cache=cache, slo=slo,
                                                  capacity_blocks=blocks, **search)
            with live_cluster(base, segments, cache=cache, block_tokens=spec.block_tokens,
                              capacity_blocks=blocks, time_scale=args.time_scale,
                              workdir=Path(tmp)) as live:
                emu_cap, probes = live_capacity(live, trace_at, slo,
                                                time_scale=args.time_scale, **search)
            rows = [_probe_row(p, trace_at(p["rate"]), cache, blocks, spec) for p in probes]
            out["live_probes_" + ("on" if cache else "off")] = [
                {k: v for k, v in p.items() if k != "timelines"} for p in probes]
            out["settings"]["on" if cache else "off"] = {
                "sim_capacity_rps": sim_cap, "emu_capacity_rps": emu_cap,
                "sim_probes": sim_probes, "probes": rows,
                "startup_s": live.startup_s}
            if cache:
                at = [p for p in probes if p["rate"] == args.rate]
                if at:
                    out["breakdown"] = _breakdown(at[0], trace_at(args.rate), blocks, spec,
                                                  args.time_scale)
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
        return
    _print(out)


def _probe_row(p: dict, trace, cache: bool, blocks: int, spec) -> dict:
    sim, _ = run_prefix(trace, cache=cache, rate=p["rate"], block_tokens=spec.block_tokens,
                        capacity_blocks=blocks)
    return {"rate": p["rate"], "met": p["met"], "emu_p50": p["p50"], "emu_p99": p["p99"],
            "emu_prefill_p50": _pct(p["prefill_ttft_s"], 50),
            "emu_prefill_p99": _pct(p["prefill_ttft_s"], 99),
            "sim_p50": sim.ttft_p50, "sim_p99": sim.ttft_p99, "failed": p["failed"],
            "errors": p["errors"], "emu_hits": p["probe_hits"], "sim_hit_rate": sim.hit_rate,
            "held_after_clear": p["held_after_clear"], "wall_s": p["wall_s"]}


def _breakdown(probe: dict, trace, blocks: int, spec, scale: float) -> dict:
    """Per request: the live timeline (dispatcher clock / ``scale``) against the simulated
    chunks, paper seconds."""
    _, sim = run_prefix(trace, cache=True, rate=0.0, block_tokens=spec.block_tokens,
                        capacity_blocks=blocks)
    plans = {p.request_id: p for p in sim.plans}
    runs: dict[str, list] = {}
    for r in sim.prefill.runs:
        runs.setdefault(r.request_id, []).append(r)
    arrival = {r.request_id: r.arrival_time for r in trace}
    rows = []
    for t in probe["timelines"]:
        rid = t["request_id"].split("-")[1]   # "fid-r<i>-<t0>"
        plan, rr = plans[rid], runs[rid]
        rows.append({"request": rid, "cached_tokens": plan.cached_tokens,
                     "sim_sp": [len(c.instances) for c in plan.chunks],
                     "emu_sp": list(t["sp_sizes"]),
                     "emu_plan_s": (t["planned"] - t["arrival"]) / scale,
                     "emu_queue_s": (t["prefill_start"] - t["planned"]) / scale,
                     "emu_prefill_s": (t["prefill_end"] - t["prefill_start"]) / scale,
                     "emu_turn_wait_s": t.get("turn_wait_s", 0.0) / scale,
                     "sim_queue_s": rr[0].start - arrival[rid],
                     "sim_prefill_s": rr[-1].end - rr[0].start})
    return {"time_scale": scale, "rows": rows}


def _print(out: dict) -> None:
    a = out["args"]
    print(f"EMULATION (live, time scale {a['time_scale']:g}) beside SIMULATION; "
          f"{out['requests']} requests, mean prompt {out['mean_prompt_tokens'] / 1e3:.1f}k "
          f"tokens, seed {a['seed']}; SLO TTFT P50 <= {out['slo_p50_s']:.2f} s, P99 <= "
          f"{out['slo_p99_s']:.2f} s ({a['slo_factor']:g}x SIM light load); paper seconds")
    print("| cache | rate | SIM P50 / P99 | EMU P50 / P99 | EMU to prefill end P50 / P99 "
          "| met (EMU) | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, s in out["settings"].items():
        for r in sorted(s["probes"], key=lambda r: r["rate"]):
            print(f"| {name} | {r['rate']:g} | {r['sim_p50']:.3f} / {r['sim_p99']:.3f} "
                  f"| {r['emu_p50']:.3f} / {r['emu_p99']:.3f} "
                  f"| {r['emu_prefill_p50']:.3f} / {r['emu_prefill_p99']:.3f} "
                  f"| {r['met']} | {r['failed']} |")
    for name, s in out["settings"].items():
        print(f"capacity, cache {name}: SIMULATION {s['sim_capacity_rps']:.2f} req/s, "
              f"EMULATION {s['emu_capacity_rps']:.2f} req/s")
    b = out.get("breakdown")
    if b:
        cached = [r for r in b["rows"] if r["cached_tokens"]]
        for k in ("plan", "queue", "prefill"):
            emu = [r[f"emu_{k}_s"] for r in cached]
            sim = [r.get(f"sim_{k}_s", 0.0) for r in cached]
            print(f"cached requests ({len(cached)}), median {k}: EMU {np.median(emu):.3f} s, "
                  f"SIM {np.median(sim):.3f} s")
