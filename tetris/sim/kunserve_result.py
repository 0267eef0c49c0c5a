"""One KunServe policy run as the benchmarks report it: the SIMULATION (``tetris/sim/kunserve.py``)
and the EMULATION (``tetris/bench/kunserve_emulated.py``) build their results here."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["policy_result"]


def policy_result(policy: str, reqs, preemptions: int, control, exchange_bytes: float,
                  regroups: Sequence[float] = (), preempted_at: Sequence[float] = ()) -> dict:
    """One policy's run as the benchmarks report it (SIMULATION here; the EMULATION of
    ``tetris/bench/kunserve_emulated.py`` reports the same fields): TTFT and TPOT percentiles
    over the requests, preemptions, drops, restores, refusals and the KV exchanged; when the
    regroupings were decided and how many preemptions came before the first (trace s)."""
    first = regroups[0] if regroups else math.inf
    ttft = np.array([r.first_token - r.arrival for r in reqs])
    tpot = np.array([(r.finish - r.first_token) / (r.output - 1) for r in reqs if r.output > 1])
    return {"policy": policy, "requests": len(reqs),
            "unfinished": int(sum(math.isnan(r.finish) for r in reqs)),
            "p50_ttft": float(np.nanpercentile(ttft, 50)),
            "p99_ttft": float(np.nanpercentile(ttft, 99)),
            "p50_tpot": float(np.nanpercentile(tpot, 50)),
            "p99_tpot": float(np.nanpercentile(tpot, 99)),
            "preemptions": preemptions,
            "drops": control.drops if control else 0,
            "restores": control.restores if control else 0,
            "refusals": len(control.refusals) if control else 0,
            "exchange_gb": exchange_bytes / 1e9,
            "regroup_s": [round(t, 3) for t in regroups],
            "preemptions_before_first_regroup": sum(t < first for t in preempted_at)}
