"""SIMULATION of decode-side prefix reuse (``[prefix_cache] decode_runs``).

A conversation's next turn resends the conversation so far; the decode instance that ran the
previous turn may still keep that turn's KV (prompt and answer, but the answer's last token).
The live dispatcher (``tetris/serve/prefix_cache.py``: ``route_to_kept``, ``finished_run``)
records those runs in the control plane's ``DecodeKept``, routes a request sharing leading
blocks with a kept run to that run's instance, and when a kept run there holds all of the
plan's cached tokens the instance copies them and the prefill pool streams no prefix shard.
``PrefixDecodeSimulation`` makes the same calls on the same ``DecodeKept``, in the same order:

1. arrival: ``best`` over the instances that are up; if one shares a block, ``route`` with
   every other instance avoided, then plan and commit; ``covering`` the plan's cached tokens
   on the chosen instance decides whether the prefix is copied there (``reused``) or streamed
   (``prefix_transfer``: the holders' pseudo-chunk on the receive link);
2. a request that completes on its instance is ``add``-ed with the block hashes of its prompt
   and its output but the last token (``kept``: request id -> hashes, from
   ``prefix_workload.decode_kept_hashes``); what falls out of ``decode_runs`` is let go.

Simplifications (as the live router's): kept KV takes no decode memory here (the live instance
frees kept runs on demand, ``KeptKV.make_room``, so a kept run never refuses a request; a copy
from a run freed that way falls back to streaming, which the simulator never needs), and the
copy itself costs no time (a device-local copy).
"""

from __future__ import annotations

from typing import Any

from tetris.control.decode_kept import DecodeKept
from tetris.sim.cluster import Simulation
from tetris.sim.decode import DecodeInstanceSim, DecodeRequest
from tetris.sim.prefix_transfer import with_prefix_shard
from tetris.sim.workload import SimRequest

__all__ = ["PrefixDecodeSimulation"]


class PrefixDecodeSimulation(Simulation):
    """``Simulation`` with decode-side reuse; ``decode_runs`` runs kept per decode instance,
    ``kept`` each request's kept block hashes (a request without one is not kept)."""

    def __init__(self, requests: list[SimRequest], *, decode_runs: int,
                 kept: dict[str, tuple[int, ...]], **kw: Any) -> None:
        super().__init__(requests, **kw)
        index = self.control.prefix_index
        if index is None or not self.decoders:
            raise ValueError("decode-side reuse needs a prefix index and simulated decode")
        self.kept = DecodeKept(index.block_tokens, decode_runs)
        self.kept_hashes = kept
        self.copied: dict[str, int] = {}     # request -> prefix tokens copied on its instance
        self.instance_of: dict[str, int] = {}

    def _admit(self, now: float, r: SimRequest, cached: dict) -> tuple[int, Any]:
        control, hashes = self.control, r.block_hashes
        instances = frozenset(range(control.router.num_instances))
        best = self.kept.best(hashes, instances - frozenset(control.router.down)) \
            if cached else None
        if best is None:
            d, plan = super()._admit(now, r, cached)
        else:
            # avoid every other instance: the router takes the holder while it is up
            d = control.route(r.request_id, r.prompt_tokens + r.output_tokens,
                              avoid=instances - {best[0]})
            plan = control.plan(r.request_id, r.prompt_tokens, now, block_hashes=hashes)
            control.commit(plan)
            tokens = plan.cached_tokens
            if tokens and self.kept.covering(d, hashes, tokens) is not None:
                self.kept.reused(tokens)
                self.copied[r.request_id] = tokens
        self.instance_of[r.request_id] = d
        return d, plan

    def _kv_runs(self, plan: Any, runs: list[Any], d: int) -> list[Any]:
        return with_prefix_shard(plan, runs, streamed=plan.request_id not in self.copied)

    def _on_kv_ready(self, now: float, d: int, req: DecodeRequest) -> None:
        super()._on_kv_ready(now, d, req)
        if req.remaining <= 0:   # its only token came from prefill: complete already
            self._completed(d, req)

    def _step_done(self, now: float, inst: DecodeInstanceSim) -> None:
        for req in inst.finish_step(now):
            self._completed(inst.index, req)

    def _completed(self, d: int, req: DecodeRequest) -> None:
        """``finished_run``: a completed run is kept on its instance (no retries here)."""
        hashes = self.kept_hashes.get(req.request_id)
        if hashes is not None:
            self.kept.add(d, req.request_id, hashes)
