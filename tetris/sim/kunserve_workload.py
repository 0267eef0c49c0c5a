"""Inputs of the KunServe simulation: a deployment profile and a BurstGPT-like trace.

The trace follows what KunServe reports of BurstGPT (§2, §6): bursty arrivals whose rate
doubles part way through "with no clear pattern", average input 642 and output 262 tokens
with long tails, prompt + output at most 4096. Arrivals are a gamma renewal process (shape
< 1 is burstier than Poisson); lengths are lognormal around those means. Seeded.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np

from tetris.control.kunserve_memory import InstanceMemory, instance_memory
from tetris.sim.kunserve import KunRequest, PoolProfile

__all__ = ["LENGTHS", "burst_trace", "load_profile", "profile_path"]

# The paper's datasets (§6, Table 3) as (mean input, mean output, most tokens per request):
# BurstGPT and ShareGPT truncated to 4K as the artifact's data scripts do; LongBench (the
# paper's 72B runs) up to the artifact's max_model_len, 16K.
LENGTHS = {"burstgpt": (642, 262, 4096), "sharegpt": (1660, 373, 4096),
           "longbench": (5900, 499, 16384)}


def profile_path(name: str) -> Path:
    """``configs/kunserve-<name>.toml`` of the installed package."""
    from tetris import configs

    path = Path(configs.__file__).parent / f"kunserve-{name}.toml"
    if not path.exists():
        raise ValueError(f"no KunServe profile {name!r} ({path})")
    return path


def load_profile(path: str | Path) -> tuple[InstanceMemory, PoolProfile]:
    data = tomllib.loads(Path(path).read_text())
    return instance_memory(**data["model"]), PoolProfile(**data["pool"])


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = np.log(mean) - sigma * sigma / 2      # E[lognormal] = exp(mu + sigma^2 / 2)
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(int)


def burst_trace(n: int, rate: float, *, seed: int, burst_at: float = 0.5,
                burst_end: float = 1.0, burst_factor: float = 2.0, shape: float = 0.5, mean_in: float = 642,
                mean_out: float = 262, max_total: int = 4096) -> list[KunRequest]:
    """``n`` requests at ``rate``/s, ``burst_factor`` x that from request ``burst_at * n`` to
    request ``burst_end * n``."""
    rng = np.random.default_rng(seed)
    i = np.arange(n)
    in_burst = (i >= int(burst_at * n)) & (i < int(burst_end * n))
    rates = np.where(in_burst, rate * burst_factor, rate)
    gaps = rng.gamma(shape, 1.0 / (shape * rates))           # mean 1 / rate
    arrivals = np.cumsum(gaps)
    prompts = _lognormal(rng, mean_in, 1.0, n)
    outputs = np.minimum(_lognormal(rng, mean_out, 1.0, n), max_total // 2)
    prompts = np.minimum(prompts, max_total - outputs)
    return [KunRequest(i, float(arrivals[i]), int(prompts[i]), int(outputs[i]))
            for i in range(n)]
