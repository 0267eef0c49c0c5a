"""KunServe against the KV-centric baselines, EMULATION and SIMULATION on one trace, side by side.

``compare`` runs every policy of the simulator (``tetris.sim.kunserve``) and of the emulation
(``tetris.bench.kunserve_emulated``) on the same seeded BurstGPT-like trace and deployment
profile. Emulated policies run in separate processes (``jobs`` at a time: each emulation is
one process of threads that sleep, and a process's interpreter lock would otherwise slow the
others' bookkeeping). The simulator's runs are microseconds of model time per event, so they
run in this process.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import time

import msgspec

from tetris.bench.kunserve_emulated import EMULATED_POLICIES, KunServeEmulation
from tetris.sim.kunserve import POLICIES, KunServeSim
from tetris.sim.kunserve_workload import (
    LENGTHS,
    burst_trace,
    load_profile,
    profile_path,
)

__all__ = ["compare", "deployment"]


def deployment(profile: str, instances: int | None = None, kv_scale: float = 1.0):
    """The profile's (memory, timing); ``instances`` and ``kv_scale`` (a fraction of each
    instance's KV region, as on a smaller GPU) shrink it for a short run."""
    mem, prof = load_profile(profile_path(profile))
    if instances is not None:
        prof = msgspec.structs.replace(prof, instances=instances)
    if kv_scale != 1.0:
        mem = msgspec.structs.replace(mem, kv_bytes=int(mem.kv_bytes * kv_scale))
    return mem, prof


BURST = (0.3, 0.7, 2.0)    # the trace: the rate doubles for the middle 40% of requests


def _trace(requests: int, rate: float, seed: int, burst=BURST, lengths: str = "burstgpt"):
    """``burst``: (first, end) request of the burst as shares of the trace, and its rate
    factor; ``lengths``: the dataset whose request lengths it draws (``LENGTHS``)."""
    at, end, factor = burst
    mean_in, mean_out, max_total = LENGTHS[lengths]
    return burst_trace(requests, rate, seed=seed, burst_at=at, burst_end=end,
                       burst_factor=factor, mean_in=mean_in, mean_out=mean_out,
                       max_total=max_total)


def _emulate(spec: dict) -> dict:
    mem, prof = deployment(spec["profile"], spec["instances"], spec["kv_scale"])
    t0 = time.perf_counter()
    out = KunServeEmulation(_trace(spec["requests"], spec["rate"], spec["seed"], spec["burst"],
                                   spec["lengths"]),
                            mem, prof,
                            spec["policy"], time_scale=spec["time_scale"],
                            round_model=spec["round_model"]).run()
    out["wall_s"] = time.perf_counter() - t0
    return out


def compare(*, profile: str = "qwen2.5-14b-tp1", requests: int = 10000, rate: float = 150.0,
            seed: int = 1, time_scale: float = 1.0, jobs: int = 3, instances: int | None = None,
            kv_scale: float = 1.0, emulate: bool = True, policies=POLICIES,
            round_model: str = "lookahead", burst=BURST, lengths: str = "burstgpt") -> dict:
    """``{"SIMULATION": {policy: result}, "EMULATION": {policy: result}}`` (EMULATION empty
    when ``emulate`` is off) for ``policies``; a group's iteration by ``round_model``."""
    mem, prof = deployment(profile, instances, kv_scale)
    sim = {}
    for policy in policies:
        t0 = time.perf_counter()
        sim[policy] = KunServeSim(_trace(requests, rate, seed, burst, lengths), mem, prof, policy,
                                  round_model=round_model).run()
        sim[policy]["mode"] = "SIMULATION"
        sim[policy]["wall_s"] = time.perf_counter() - t0
    emu = {}
    if emulate:
        specs = [{"profile": profile, "instances": instances, "kv_scale": kv_scale,
                  "requests": requests, "rate": rate, "seed": seed, "time_scale": time_scale,
                  "policy": p, "round_model": round_model, "burst": burst, "lengths": lengths}
                 for p in EMULATED_POLICIES if p in policies]
        with cf.ProcessPoolExecutor(max_workers=jobs,
                                    mp_context=mp.get_context("spawn")) as pool:
            for spec, out in zip(specs, pool.map(_emulate, specs), strict=True):
                emu[spec["policy"]] = out
    return {"profile": prof.name, "instances": prof.instances, "kv_blocks": mem.kv_blocks,
            "requests": requests, "rate": rate, "seed": seed, "time_scale": time_scale,
            "round_model": round_model, "burst": list(burst), "lengths": lengths,
            "SIMULATION": sim, "EMULATION": emu}
