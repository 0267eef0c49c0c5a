"""The two pool deployments: each hosts its actors and answers the dispatcher's calls.

``PrefillPoolServer`` owns the SP pool's worker actors (``tetris.actors.prefill.pool``) and
runs plans in commit order; ``DecodePoolServer`` owns the decode instances, each a TP group
of rank actors with continuous batching. Neither decides anything: the dispatcher does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
from ray import serve

from tetris.actors.process_env import runtime_env
from tetris.config import DeploymentConfig
from tetris.serve.kunserve_served import KunServePool

__all__ = ["PrefillPoolServer", "DecodePoolServer", "NO_CPU"]

# control processes: mostly waiting, never refused a slot; the process environment that keeps
# their memory flat (actors/process_env.py)
NO_CPU = {"num_cpus": 0, "runtime_env": runtime_env(control=True)}


@serve.deployment(ray_actor_options=NO_CPU, max_ongoing_requests=1024)
class PrefillPoolServer:
    """Hosts the SP pool's worker actors; runs plans in the order they were committed."""

    def __init__(self, deployment: DeploymentConfig, max_concurrent_runs: int = 256) -> None:
        from tetris.actors.prefill.pool import PrefillPool

        self.pool = PrefillPool(deployment)
        self.infos = self.pool.enable_transfer(deployment.transfer)
        # pool.run blocks its thread for a whole prefill and waits its turn on shared
        # instances: one thread per request in flight, or later plans could starve earlier ones.
        self._threads = ThreadPoolExecutor(max_workers=max_concurrent_runs,
                                           thread_name_prefix="tetris-prefill")

    async def _call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, lambda: fn(*args, **kwargs))

    async def peers(self) -> dict:
        """sender id -> (actor handle, agent info)."""
        return {i: (w, self.infos[i]) for i, w in enumerate(self.pool.workers)}

    async def replacements(self) -> int:
        """Dead workers replaced so far."""
        return self.pool.replacements

    async def connect_receivers(self, peers: dict) -> None:
        await self._call(self.pool.connect_receivers, peers)

    async def heal(self) -> list[int]:
        """Replace workers found dead though no chunk ran on them (``PrefillPool.heal``)."""
        return await self._call(self.pool.heal)

    async def node_map(self) -> list[int]:
        return list(self.pool.node_map())

    async def commit(self, plan, wait_replacing: bool = False) -> list[float]:
        return self.pool.commit(plan, wait_replacing=wait_replacing)

    async def busy_for(self) -> list[float]:
        return self.pool.busy_for()

    async def run(self, plan, token_ids, sampling, kv_receivers, prefix_streamed=True,
                  kv_ranges=()):
        # token_ids: the dispatcher's int32 array, handed on as is (the pool slices it);
        # kv_ranges: elastic decode's targets per token range, in place of kv_receivers
        return await self._call(self.pool.run, plan, token_ids, sampling=sampling,
                                kv_receivers=tuple(kv_receivers), prefix_streamed=prefix_streamed,
                                kv_ranges=tuple(kv_ranges))

    async def release(self, request_id: str) -> None:
        await self._call(self.pool.release, request_id)

    async def abort(self, request_id: str) -> None:
        await self._call(self.pool.abort, request_id)

    async def held(self) -> dict:
        return await self._call(self.pool.held_requests)


@serve.deployment(ray_actor_options=NO_CPU, max_ongoing_requests=1024)
class DecodePoolServer(KunServePool):
    """Hosts the decode instances (TP groups of actors with continuous batching)."""

    def __init__(self, deployment: DeploymentConfig) -> None:
        from tetris.actors.decode.instance import DecodeInstance

        self.instances = [DecodeInstance(deployment, d, transfer=deployment.transfer)
                          for d in range(deployment.decode.num_instances)]
        self.deployment_elastic = deployment.decode.elastic
        self.deployment_kunserve = deployment.kunserve
        self._started = asyncio.Lock()
        self._up = False
        self.world = None   # [decode] elastic: the instances' ElasticWorld

    async def start(self) -> None:
        async with self._started:
            if not self._up:
                for inst in self.instances:
                    await inst.start()
                if self.deployment_elastic:
                    from tetris.actors.decode.elastic_pool import ElasticWorld

                    self.world = ElasticWorld(self.instances)
                    await self.world.start()
                if self.deployment_kunserve.enabled:   # tetris/serve/kunserve_served.py
                    await self._start_kunserve(self.deployment_kunserve)
                self._up = True

    async def kv_capacities(self) -> list[int]:
        """Per instance: its KV token slots as its ranks reported them at start (with
        ``decode.kv_blocks = 0`` on CUDA, sized from each rank's GPU memory)."""
        return [inst.kv_capacity_tokens for inst in self.instances]

    async def receiver_ids(self) -> list[tuple[int, ...]]:
        return [tuple(inst.receiver_ids) for inst in self.instances]

    async def peers(self) -> dict:
        """receiver id -> (rank actor handle, agent info)."""
        out = {}
        for inst in self.instances:
            infos = await inst.agent_infos()
            for rid, rank, info in zip(inst.receiver_ids, inst.ranks, infos):
                out[rid] = (rank, info)
        return out

    async def connect_senders(self, senders: dict) -> None:
        for inst in self.instances:
            await inst.connect_senders(senders)

    async def health(self) -> list[str | None]:
        """Per instance: None when serving, else why it broke (a dead rank is found here even
        while the instance is idle)."""
        errors = await asyncio.gather(*[inst.check() for inst in self.instances])
        if any(errors) and await self._kunserve_rebuild():   # survivors serve again in place
            errors = [inst.broken for inst in self.instances]
        return [None if err is None else f"{type(err).__name__}: {err}" for err in errors]

    async def recover(self, instance: int, senders: dict) -> dict:
        """Restart a broken instance connected to ``senders`` (sender id -> actor); returns its
        receivers' new (rank handle, agent info), which the prefill workers must be given
        before they can stream to it."""
        inst = self.instances[instance]
        await self._kunserve_rebuild()   # a KunServe group with a broken member is let go
        await inst.restart(senders)
        infos = await inst.agent_infos() if inst.transfer is not None else [None] * inst.tp_size
        return {rid: (rank, info) for rid, rank, info in zip(inst.receiver_ids, inst.ranks, infos)}

    async def reserve(self, instance: int, request_id: str, prompt, sampling,
                      generated=(), **prefix) -> None:
        # prefix: keep / prefix_from / prefix_tokens (prefix caching's decode side); no KV
        # room: KunServe's controller decides first when enabled (kunserve_served.py)
        await self._reserve_or_tick(instance, lambda: self.instances[instance].reserve(
            request_id, prompt, sampling, generated, **prefix), len(prompt) + len(generated))

    # -- elastic decode: a request's ranges over a decode group (ElasticWorld) ------------
    async def elastic_place(self, request_id: str, prompt, sampling, ranges,
                            generated=()) -> None:
        """``Hold`` each (instance, start, end) but the last, ``Lead`` and ``Reserve``
        from its start on the last (the master); ``DecodeFull`` if the master has no room.
        ``generated``: a resumed request's output so far (its KV is in the ranges too)."""
        await self.world.place(request_id, prompt, sampling, [tuple(r) for r in ranges],
                               generated)

    async def elastic_commit(self, request_id: str, ranges, first_token: int,
                             logprob=None) -> None:
        await self.world.commit(request_id, [tuple(r) for r in ranges], first_token, logprob)

    async def elastic_release(self, request_id: str, ranges) -> None:
        self.world.release(request_id, [tuple(r) for r in ranges])

    async def drop_kept(self, instance: int, run_id: str) -> None:
        self.instances[instance].drop_kept(run_id)

    async def commit(self, instance: int, request_id: str, first_token: int,
                     logprob=None) -> None:
        self.instances[instance].commit(request_id, first_token, logprob)

    async def stream(self, instance: int, request_id: str) -> AsyncIterator:
        # Deltas (OutputDelta), merged when this hop falls behind: neither the prompt nor the
        # output so far travels with every token.
        async for out in self.instances[instance].stream(request_id):
            yield out

    async def abort(self, instance: int, request_id: str) -> None:
        self.instances[instance].abort(request_id)

    async def stats(self) -> list:
        return [inst.stats() for inst in self.instances]

    async def step_times(self) -> list[dict[str, list[float]]]:
        """Per instance: rank 0's engine step times and the driver's round times (s) of the
        recent rounds that made tokens."""
        return [{"step": list(inst.step_times), "round": list(inst.round_times)}
                for inst in self.instances]

    async def held(self) -> list[dict]:
        """Per instance, per TP rank: what is still held (all ``empty`` when idle)."""
        out = []
        for inst in self.instances:
            ranks = await inst.held()
            out.append({"ranks": [msgspec.to_builtins(h) | {"empty": h.empty} for h in ranks]})
        return out
