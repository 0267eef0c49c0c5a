"""The dispatcher deployment: ``tetris.serve.dispatcher`` on a uvloop event loop, with the
supervisor (``tetris.serve.supervisor``) beside it and the admin surface the ingress calls.

At first use it wires the pools together (prefill workers learn each decode rank's transfer
agent and actor handle, decode ranks learn the workers' handles) and builds the dispatcher.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
from ray import serve

from tetris.config import DeploymentConfig
from tetris.model.loader import load_tokenizer_for, resolve_model_config
from tetris.serve.first_token import EarlyFirstToken
from tetris.serve.handles import DecodeHandleClient, PrefillHandleClient
from tetris.serve.pools import NO_CPU
from tetris.serve.protocol import GenerateRequest
from tetris.serve.supervisor import Supervisor, actor_handles, check_period

__all__ = ["DispatcherServer", "early_first_token", "PREFILL_CHECK_S"]

# how often (s) the prefill pool is probed for workers that died idle
PREFILL_CHECK_S = 2.0


@serve.deployment(ray_actor_options=NO_CPU, max_ongoing_requests=4096)
class DispatcherServer:
    """The dispatcher (``tetris.serve.dispatcher``) on a uvloop event loop."""

    def __init__(self, deployment: DeploymentConfig, prefill, decode, max_pending: int = 256,
                 prefill_check_s: float = PREFILL_CHECK_S):
        self.deployment = deployment
        self._prefill_h, self._decode_h = prefill, decode
        self.max_pending = max_pending
        self.prefill_check_s = check_period(prefill_check_s)
        self.dispatcher = None
        self.supervisor: Supervisor | None = None
        self._lock = asyncio.Lock()

    async def ready(self):
        """Wire the pools together and build the dispatcher (once)."""
        async with self._lock:
            if self.dispatcher is not None:
                return self.dispatcher
            from tetris.serve.dispatcher import Dispatcher
            from tetris.serve.metrics import ServingMetrics

            await self._decode_h.start.remote()
            senders = await self._prefill_h.peers.remote()
            receivers = await self._decode_h.peers.remote()
            await self._prefill_h.connect_receivers.remote(receivers)
            await self._decode_h.connect_senders.remote(actor_handles(senders))
            node_of = await self._prefill_h.node_map.remote()
            # the instances' KV slots as their ranks allocated them (decode.kv_blocks = 0 on
            # CUDA: sized from each rank's GPU), not the configured count
            capacities = await self._decode_h.kv_capacities.remote()
            self.metrics = ServingMetrics(self.deployment.model.name, requests=False)
            self.dispatcher = Dispatcher(
                self.deployment, PrefillHandleClient(self._prefill_h),
                DecodeHandleClient(self._decode_h, await self._decode_h.receiver_ids.remote()),
                node_of=node_of, decode_capacities=capacities,
                metrics=self.metrics, max_pending=self.max_pending,
                first_token=early_first_token(self.deployment), relay=True)
            self.supervisor = Supervisor(self.dispatcher, self.metrics, self._prefill_h,
                                         self._decode_h, self.prefill_check_s)
            self.supervisor.start()
            return self.dispatcher

    async def set_prefill_check(self, seconds: float) -> float:
        """How often the prefill pool is probed for workers that died idle (0: never; a chunk
        still finds a dead member, and a request it fails runs again). Returns the old period."""
        old, self.prefill_check_s = self.prefill_check_s, check_period(seconds)
        if self.supervisor is not None:
            self.supervisor.prefill_check_s = self.prefill_check_s
        return old

    async def warmup(self) -> dict:
        """Wire the pools now (``tetris serve`` calls this before it prints the URL)."""
        await self.ready()
        return {"event_loop": type(asyncio.get_running_loop()).__module__}

    async def generate(self, req: GenerateRequest) -> AsyncIterator:
        d = await self.ready()
        async for out in d.generate(req):
            yield out

    async def relay_report(self, run_id: str, report) -> bool:
        """The ingress's report on a run whose decode outputs it streams itself."""
        return (await self.ready()).relay_report(run_id, report)

    async def stats(self) -> dict:
        return (await self.ready()).stats() | {"decode_restarts": dict(self.supervisor.restarts)}

    async def held(self) -> dict:
        d = await self.ready()
        return {"dispatcher": d.held(), "prefill": await self._prefill_h.held.remote(),
                "decode": await self._decode_h.held.remote()}

    async def prefix_cache(self, clear: bool = False) -> dict:
        """``/admin/prefix_cache``: the prefix index's state (``clear``: after clearing it)."""
        return await (await self.ready()).prefix_cache(clear)

    async def metrics_text(self) -> bytes:
        await self.ready()
        return self.metrics.render()

    async def timelines(self, last: int = 100) -> list[dict]:
        d = await self.ready()
        return [msgspec.to_builtins(t) | {"breakdown": t.breakdown()} for t in list(d.timelines)[-last:]]

    async def plans(self) -> list[dict]:
        return list((await self.ready()).plans)

    async def rate_table(self, update: dict | None = None) -> dict:
        d = await self.ready()
        if update is None:
            return d.rate_table()
        return d.set_rate_table(update.get("rates", []), update.get("improvement_rates", []),
                                update.get("description", ""))

    async def drain(self, instances: list[int], seconds: float) -> dict:
        return (await self.ready()).drain(instances, seconds)

    async def latency_profile(self, update: dict | None = None) -> dict:
        d = await self.ready()
        return d.latency_profile() if update is None else d.set_latency_profile(update)


def early_first_token(deployment: DeploymentConfig):
    """What the dispatcher needs to stream the first token as the decode engines would."""
    resolved = resolve_model_config(deployment.model)
    if deployment.decode.executor == "emulated":
        # emulated engines have no tokenizer and no EOS (actors/decode/emulated.py)
        return EarlyFirstToken(None, (), resolved.max_position_embeddings)
    tokenizer = load_tokenizer_for(resolved)
    return EarlyFirstToken(tokenizer.decode, tokenizer.eos_token_ids, resolved.max_position_embeddings)
