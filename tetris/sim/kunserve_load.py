"""How much of a decode pool's throughput a trace asks for: what KunServe's TPOT is bound by.

A decode iteration of ``b`` sequences holding ``ctx`` tokens costs ``T(b, ctx) = W + b per_seq
+ ctx kv_tok/hbm`` (``tetris/sim/kunserve.py``), ``W = params/hbm`` the weight load the whole
batch shares. A token decoded at context ``c`` thus costs one instance ``per_seq + c
kv_tok/hbm`` on top of ``W``. The *decode load* of a window of arrivals is that work over the
window's instance-seconds:

    rho = sum over its requests, over their decode steps, of (per_seq + context kv_tok/hbm)
          / (window seconds * instances)

A pool that admits every request on arrival (KV memory enough, nothing queued) settles where
each iteration decodes the work that arrived during it: an iteration's batch work is ``rho
T``, so ``T = W + rho T``:

    TPOT without queueing = W / (1 - rho)            (rho < 1; for rho >= 1 the batch grows
                                                      until memory stops it)

A pool that queues instead caps its batch at what its KV holds, so its TPOT stays bounded as
rho nears 1, and its waiting requests pay in TTFT. ``W / (1 - rho)`` is the steady limit; a
finite burst does not reach it (the batch builds up over many request lifetimes), so
``no_queue_sim`` measures the no-queue TPOT of a trace: the same simulator with the KV memory
and the batch cap out of the way. KunServe serves from its enlarged KV without queueing, so
its TPOT cannot be much lower than that. Pure: no torch, no ray.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import msgspec

from tetris.control.kunserve_memory import InstanceMemory
from tetris.sim.kunserve import KunServeSim

__all__ = ["decode_load", "decode_work_s", "no_queue_sim", "no_queue_tpot", "phase_loads"]


def decode_work_s(prompt: int, output: int, mem: InstanceMemory, prof) -> float:
    """Instance-seconds one request's decode steps add to their iterations beyond ``W``: the
    prefill samples the first token, step ``j`` (1..output-1) reads ``prompt + j`` tokens."""
    steps = output - 1
    if steps <= 0:
        return 0.0
    kv_s = mem.block_bytes / mem.block_size / prof.hbm_bytes_per_s
    return steps * prof.per_seq_s + kv_s * (steps * prompt + steps * (steps + 1) / 2)


def decode_load(reqs: Sequence, mem: InstanceMemory, prof) -> float:
    """``rho`` of requests arriving in order (module docstring): their decode work over the
    instance-seconds between the first arrival and the last."""
    if len(reqs) < 2:
        raise ValueError("a load needs at least two arrivals to span a window")
    window = reqs[-1].arrival - reqs[0].arrival
    work = sum(decode_work_s(r.prompt, r.output, mem, prof) for r in reqs)
    return work / (window * prof.instances)


def phase_loads(reqs: Sequence, mem: InstanceMemory, prof,
                burst: tuple[float, float]) -> list[float]:
    """``rho`` before, in and after the burst (requests ``burst[0] n`` to ``burst[1] n``);
    a phase with fewer than two arrivals has none (NaN)."""
    n = len(reqs)
    cuts = (0, int(burst[0] * n), int(burst[1] * n), n)
    return [decode_load(reqs[a:b], mem, prof) if b - a >= 2 else math.nan
            for a, b in itertools.pairwise(cuts)]


def no_queue_tpot(mem: InstanceMemory, prof, rho: float) -> float:
    """``W / (1 - rho)``: the steady TPOT of a pool that queues nothing (inf for rho >= 1)."""
    weights = mem.param_bytes / prof.hbm_bytes_per_s
    return weights / (1.0 - rho) if rho < 1.0 else math.inf


def no_queue_sim(reqs: list, mem: InstanceMemory, prof, *, kv_scale: int = 20) -> KunServeSim:
    """The simulated pool with ``kv_scale`` x the KV region and no batch cap, preempting by
    recompute (it never needs to): every request decodes from its arrival, so its run's TPOTs
    are what serving the trace without queueing costs."""
    big = msgspec.structs.replace(mem, kv_bytes=mem.kv_bytes * kv_scale)
    roomy = msgspec.structs.replace(prof, max_batch=1 << 30)
    return KunServeSim(reqs, big, roomy, "recompute")
