"""The improvement-rate profiler (SPEC §4, paper §5): arrival rate -> the θ with the lowest TTFT.

For each rate on the grid and each θ on the θ grid, the profiler simulates the prefill pool
(no decode: TTFT depends on prefill only) with the Tetris policy at that fixed θ over several
seeds of Poisson arrivals from the trace's length distribution, and records the θ with the
lowest **mean** TTFT over the pooled requests (ties: the smaller θ). The seeds are drawn from
a range disjoint from the evaluation seeds so that the table is not fitted to the runs it is
judged on. The result is an ``ImprovementRateTable`` file under ``configs/rates/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from tetris.sim.experiments import RunSpec, make_requests, run_one
from tetris.sim.workload import OUTPUT_LENGTHS

__all__ = ["DEFAULT_THETAS", "PROFILE_SEED_BASE", "profile_rates", "default_rate_grid"]

DEFAULT_THETAS = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75)
PROFILE_SEED_BASE = 1000


def default_rate_grid(model: str, workload: str) -> list[float]:
    """0.5 req/s steps (the paper's) up to a little past where Tetris saturates."""
    top = {"8b": {"short": 9.0, "medium": 6.5, "long": 4.5},
           "70b": {"short": 2.0, "medium": 1.5, "long": 1.0}}.get(model, {}).get(workload, 8.0)
    step = 0.5 if top > 3 else 0.125  # 70B saturates near 1 req/s: a finer grid
    return [round(step * k, 3) for k in range(1, int(top / step) + 1)]


def profile_rates(model: str, workload: str, rates: Sequence[float],
                  thetas: Sequence[float] = DEFAULT_THETAS, seeds: int = 3,
                  requests: int = 500, progress=None,
                  output_mean: float = OUTPUT_LENGTHS.mean_tokens, execution: str = "profile"
                  ) -> tuple[list[float], list[float], list[dict]]:
    """Returns (rates, best θ per rate, every grid point's mean TTFT).

    ``output_mean`` only sets the sampled output lengths: prefill-only runs do not read them,
    and arrivals and prompts do not depend on them, so the table is the same at every output
    mean (a test checks this); the argument keeps the recorded workload honest.
    ``execution``: the simulated hardware's chunk times (``RunSpec.execution``).
    """
    if not rates or not thetas or seeds <= 0:
        raise ValueError("profiling needs at least one rate, one θ and one seed")
    best, grid = [], []
    for rate in rates:
        reqs = [make_requests(workload, rate, requests, PROFILE_SEED_BASE + s, output_mean) for s in range(seeds)]
        means = []
        for theta in thetas:
            spec = RunSpec(model=model, workload=workload, policy="tetris", rate=rate,
                           requests=requests, improvement_rate=theta, decode=False,
                           execution=execution)
            ttfts = np.concatenate([run_one(spec, r)[0].ttft_s for r in reqs])
            means.append(float(ttfts.mean()))
            grid.append({"rate": rate, "theta": theta, "ttft_mean": means[-1]})
            if progress is not None:
                progress.update(1)
        best.append(float(thetas[int(np.argmin(means))]))  # argmin takes the first: smaller θ
    return [float(r) for r in rates], best, grid


def save_table(path: str | Path, rates: list[float], thetas: list[float], *, model: str,
               workload: str, note: str = "") -> Path:
    from tetris.scheduler.rate import ImprovementRateTable

    note = note or (f"tetris sim profile-rate --model {model} --workload {workload}: "
                    f"θ with the lowest mean TTFT per rate")
    return ImprovementRateTable(rates, thetas, description=note).save(path)
