"""The Ray Serve application: ``build_app(config)``.

Deployment graph (one replica each; the pools are stateful)::

    HTTP /v1/... ──► Ingress (FastAPI: OpenAI API, /metrics, /admin/...)
    handle.generate / generate_stream ──┘   │ tokenizes, validates, streams
                                            ▼
                                   Dispatcher (asyncio on uvloop)
                                   CDSP policy + live queue, decode router, rate monitor
                        commit/run plan │                    │ reserve/commit/stream
                                        ▼                    ▼
                         PrefillPoolServer            DecodePoolServer
                         N PrefillWorker actors       M DecodeInstances, each a TP group
                         (one gloo world)             of DecodeRank actors
                                        └── KV, layer by layer ──┘
                             (NIXL writes; control messages actor to actor)

The pools own the actors; the dispatcher owns the control state; the ingress owns nothing
but the HTTP (and handle) surface. At first use the dispatcher wires the pools together:
prefill workers learn each decode rank's NIXL agent and actor handle, decode ranks learn the
workers' actor handles.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
from ray import serve

from tetris.actors.process_env import runtime_env
from tetris.config import DeploymentConfig, load_deployment
from tetris.engine.request import Transcript
from tetris.errors import InstanceLost, InstanceReplacing, PlanOutdated
from tetris.serve.backend import Overloaded
from tetris.serve.protocol import GenerateRequest
from tetris.serve.types import Generation, GenerationDelta, GenerationRequest
from tetris.token_ids import compact_tokens

__all__ = ["build_app", "app_builder", "APP_NAME", "Ingress", "DispatcherServer",
           "PrefillPoolServer", "DecodePoolServer"]

log = logging.getLogger(__name__)

APP_NAME = "tetris"
# how often (s) the dispatcher has the prefill pool probe its workers for ones that died idle
PREFILL_CHECK_S = 2.0
# control processes: mostly waiting, never refused a slot; the process environment that keeps
# their memory flat (actors/process_env.py)
_NO_CPU = {"num_cpus": 0, "runtime_env": runtime_env(control=True)}


@serve.deployment(ray_actor_options=_NO_CPU, max_ongoing_requests=1024)
class PrefillPoolServer:
    """Hosts the SP pool's worker actors; runs plans in the order they were committed."""

    def __init__(self, deployment: DeploymentConfig, max_concurrent_runs: int = 256) -> None:
        from tetris.actors.prefill_pool import PrefillPool

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

    async def run(self, plan, token_ids, sampling, kv_receivers):
        # token_ids: the dispatcher's int32 array, handed on as is (the pool slices it)
        return await self._call(self.pool.run, plan, token_ids, sampling=sampling,
                                kv_receivers=tuple(kv_receivers))

    async def release(self, request_id: str) -> None:
        await self._call(self.pool.release, request_id)

    async def abort(self, request_id: str) -> None:
        await self._call(self.pool.abort, request_id)

    async def held(self) -> dict:
        return await self._call(self.pool.held_requests)


@serve.deployment(ray_actor_options=_NO_CPU, max_ongoing_requests=1024)
class DecodePoolServer:
    """Hosts the decode instances (TP groups of actors with continuous batching)."""

    def __init__(self, deployment: DeploymentConfig) -> None:
        from tetris.actors.decode_instance import DecodeInstance

        self.instances = [DecodeInstance(deployment, d, transfer=deployment.transfer)
                          for d in range(deployment.decode.num_instances)]
        self._started = asyncio.Lock()
        self._up = False

    async def start(self) -> None:
        async with self._started:
            if not self._up:
                for inst in self.instances:
                    await inst.start()
                self._up = True

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
        return [None if err is None else f"{type(err).__name__}: {err}" for err in errors]

    async def recover(self, instance: int, senders: dict) -> dict:
        """Restart a broken instance connected to ``senders`` (sender id -> actor); returns its
        receivers' new (rank handle, agent info), which the prefill workers must be given
        before they can stream to it."""
        inst = self.instances[instance]
        await inst.restart(senders)
        infos = await inst.agent_infos() if inst.transfer is not None else [None] * inst.tp_size
        return {rid: (rank, info) for rid, rank, info in zip(inst.receiver_ids, inst.ranks, infos)}

    async def reserve(self, instance: int, request_id: str, prompt, sampling,
                      generated=()) -> None:
        await self.instances[instance].reserve(request_id, prompt, sampling, generated)

    async def commit(self, instance: int, request_id: str, first_token: int) -> None:
        self.instances[instance].commit(request_id, first_token)

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


class _PrefillHandleClient:
    def __init__(self, handle) -> None:
        self.h = handle

    async def commit(self, plan, wait_replacing: bool = False) -> list[float]:
        try:
            return await self.h.commit.remote(plan, wait_replacing)
        except Exception as e:
            if _raised(e, InstanceReplacing):
                raise InstanceReplacing(str(e).strip().splitlines()[-1],
                                        getattr(e, "instances", ())) from None
            raise

    async def busy_for(self) -> list[float]:
        return await self.h.busy_for.remote()

    async def run(self, plan, token_ids, sampling, kv_receivers):
        try:
            return await self.h.run.remote(plan, token_ids, sampling, kv_receivers)
        except Exception as e:
            raise _lost(e) from None

    async def release(self, request_id: str) -> None:
        await self.h.release.remote(request_id)

    async def abort(self, request_id: str) -> None:
        await self.h.abort.remote(request_id)


class _DecodeHandleClient:
    def __init__(self, handle, receivers: list[tuple[int, ...]]) -> None:
        self.h = handle
        self.receivers = receivers

    def receiver_ids(self, instance: int) -> tuple[int, ...]:
        return self.receivers[instance]

    async def reserve(self, instance, request_id, prompt, sampling, generated=()) -> None:
        try:
            await self.h.reserve.remote(instance, request_id, prompt, sampling, generated)
        except Exception as e:
            from tetris.actors.decode_instance import DecodeError, DecodeFull

            if _raised(e, DecodeFull):
                raise Overloaded(f"decode instance {instance} has no KV room: {e}",
                                 retry_after_s=getattr(e, "retry_after_s", 1.0)) from None
            if _raised(e, DecodeError):   # broken or restarting: the dispatcher heals it
                raise Overloaded(f"decode instance {instance} is unavailable: {e}",
                                 retry_after_s=2.0) from None
            raise

    async def commit(self, instance, request_id, first_token) -> None:
        try:
            await self.h.commit.remote(instance, request_id, first_token)
        except Exception as e:
            raise _lost(e) from None

    async def stream(self, instance, request_id) -> AsyncIterator:
        gen = self.h.options(stream=True).stream.remote(instance, request_id)
        try:
            async for out in gen:
                yield out
        except Exception as e:
            raise _lost(e) from None
        finally:
            gen.cancel()

    async def abort(self, instance, request_id) -> None:
        await self.h.abort.remote(instance, request_id)

    async def stats(self) -> list:
        return await self.h.stats.remote()


def _handles(peers: dict) -> dict:
    """id -> actor handle, from a ``peers()`` table of id -> (handle, agent info)."""
    return {i: handle for i, (handle, _info) in peers.items()}


def _check_period(seconds: float) -> float:
    seconds = float(seconds)
    if not seconds >= 0:
        raise ValueError(f"a health check period must be >= 0 s (0: off), got {seconds}")
    return seconds


def _lost(err: BaseException) -> BaseException:
    """``err`` as an ``InstanceLost`` (a ``PlanOutdated`` when it was one) when a pool raised
    one (the dispatcher then runs the request again), else ``err`` itself."""
    for cls in (PlanOutdated, InstanceLost):
        if _raised(err, cls):
            return err if type(err) is cls else cls(str(err).strip().splitlines()[-1])
    return err


def _raised(err: BaseException, cls: type) -> bool:
    """Whether ``err`` is ``cls`` raised in another process (Ray re-raises it as a subclass
    of both its own error type and ``cls``, or under a name that contains ``cls``'s)."""
    return isinstance(err, cls) or cls.__name__ in type(err).__name__


@serve.deployment(ray_actor_options=_NO_CPU, max_ongoing_requests=4096)
class DispatcherServer:
    """The dispatcher (``tetris.serve.dispatcher``) on a uvloop event loop."""

    def __init__(self, deployment: DeploymentConfig, prefill, decode, max_pending: int = 256,
                 prefill_check_s: float = PREFILL_CHECK_S):
        self.deployment = deployment
        self._prefill_h, self._decode_h = prefill, decode
        self.max_pending = max_pending
        self.dispatcher = None
        self._lock = asyncio.Lock()
        self._load_task = None
        self._healing: dict[int, asyncio.Task] = {}   # decode instance -> its restart task
        self.restarts: dict[int, int] = {}            # decode instance -> restarts that succeeded
        self._prefill_healing: asyncio.Task | None = None
        self._last_prefill_check = 0.0
        self.prefill_check_s = _check_period(prefill_check_s)

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
            await self._decode_h.connect_senders.remote(_handles(senders))
            node_of = await self._prefill_h.node_map.remote()
            dc = self.deployment.decode
            self.metrics = ServingMetrics(self.deployment.model.name, requests=False)
            self.dispatcher = Dispatcher(
                self.deployment, _PrefillHandleClient(self._prefill_h),
                _DecodeHandleClient(self._decode_h, await self._decode_h.receiver_ids.remote()),
                node_of=node_of, decode_capacities=[dc.kv_blocks * dc.block_size] * dc.num_instances,
                metrics=self.metrics, max_pending=self.max_pending,
                first_token=_early_first_token(self.deployment))
            self._load_task = asyncio.get_running_loop().create_task(self._poll_load())
            return self.dispatcher

    async def _poll_load(self) -> None:
        while True:
            try:
                stats = await self.dispatcher.refresh_decode_load()
                for i, s in enumerate(stats):
                    if s is not None:
                        self.metrics.set_kv_usage(i, 1.0 - s.free_blocks / s.total_blocks)
            except Exception:  # noqa: BLE001 - load polling is best effort
                pass
            try:
                await self._heal_decode()
            except Exception as e:  # noqa: BLE001 - tried again at the next poll
                log.warning("decode health check failed: %s", e)
            self._heal_prefill()
            await asyncio.sleep(0.5)

    async def set_prefill_check(self, seconds: float) -> float:
        """How often the prefill pool is probed for workers that died idle (0: never; a chunk
        still finds a dead member, and a request it fails runs again). Returns the old period."""
        old, self.prefill_check_s = self.prefill_check_s, _check_period(seconds)
        return old

    def _heal_prefill(self) -> None:
        """Every ``prefill_check_s``, have the pool replace workers that died idle, in a task
        (replacing waits for running chunks to finish; load polling goes on meanwhile)."""
        loop = asyncio.get_running_loop()
        if (not self.prefill_check_s or self._prefill_healing is not None
                or loop.time() - self._last_prefill_check < self.prefill_check_s):
            return
        self._last_prefill_check = loop.time()

        async def heal() -> None:
            try:
                replaced = await self._prefill_h.heal.remote()
                if replaced:
                    log.error("prefill workers %s had died idle: replaced", replaced)
            except Exception as e:  # noqa: BLE001 - tried again at the next check
                log.warning("prefill health check failed: %s", e)
            finally:
                self._prefill_healing = None

        self._prefill_healing = loop.create_task(heal())

    async def _heal_decode(self) -> None:
        """Take broken decode instances out of routing and restart each in a task of its own
        (load polling goes on meanwhile)."""
        for i, err in enumerate(await self._decode_h.health.remote()):
            if err is None or i in self._healing:
                continue
            if i not in self.dispatcher.router.down:
                log.error("decode instance %d broke (%s): routing around it and restarting", i, err)
                self.dispatcher.set_decode_up(i, False)
            task = asyncio.get_running_loop().create_task(self._restart_decode(i))
            self._healing[i] = task
            task.add_done_callback(lambda _t, i=i: self._healing.pop(i, None))

    async def _restart_decode(self, i: int) -> None:
        """Restart decode instance ``i`` connected to the prefill workers as they are now (the
        pool may have replaced some since), give them its new transfer agents and route to it
        again; a failed try waits 1, 2, 4, ... up to 60 s before the next."""
        wait, peers = 1.0, None
        while True:
            try:
                if peers is None:
                    senders = await self._prefill_h.peers.remote()
                    peers = await self._decode_h.recover.remote(i, _handles(senders))
                await self._prefill_h.connect_receivers.remote(peers)
                break
            except Exception as e:  # noqa: BLE001 - stays down; tried again
                if peers is not None and (await self._decode_h.health.remote())[i] is not None:
                    peers = None   # it broke again: restart it again; else only reconnect
                log.error("decode instance %d: restart failed (%s); next try in %.0f s", i, e, wait)
                await asyncio.sleep(wait)
                wait = min(60.0, 2 * wait)
        self.dispatcher.set_decode_up(i, True)
        self.restarts[i] = self.restarts.get(i, 0) + 1
        self.metrics.count_decode_restart(i)
        log.warning("decode instance %d restarted; routing to it again", i)

    async def warmup(self) -> dict:
        """Wire the pools now (``tetris serve`` calls this before it prints the URL)."""
        await self.ready()
        return {"event_loop": type(asyncio.get_running_loop()).__module__}

    async def generate(self, req: GenerateRequest) -> AsyncIterator:
        d = await self.ready()
        async for out in d.generate(req):
            yield out

    async def stats(self) -> dict:
        return (await self.ready()).stats() | {"decode_restarts": dict(self.restarts)}

    async def held(self) -> dict:
        d = await self.ready()
        return {"dispatcher": d.held(), "prefill": await self._prefill_h.held.remote(),
                "decode": await self._decode_h.held.remote()}

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


class _DispatcherBackend:
    """``GenerationBackend`` over the dispatcher's handle (what the OpenAI API calls)."""

    def __init__(self, deployment: DeploymentConfig, handle) -> None:
        from tetris.model.loader import resolve_model_config

        self.handle = handle
        self.model_name = deployment.model.name
        resolved = resolve_model_config(deployment.model)
        self.max_model_len = resolved.max_position_embeddings
        self._tokenizer = _tokenizer_for(resolved)
        self._stats: dict = {}

    @property
    def tokenizer(self):
        return self._tokenizer

    async def generate(self, req: GenerateRequest) -> AsyncIterator:
        gen = self.handle.options(stream=True).generate.remote(req)
        try:
            async for out in gen:
                yield out
        except Exception as e:
            raise _unwrap(e) from None
        finally:
            gen.cancel()

    async def stats(self) -> dict:
        return await self.handle.stats.remote()


def _early_first_token(deployment: DeploymentConfig):
    """What the dispatcher needs to stream the first token as the decode engines would."""
    from tetris.model.loader import resolve_model_config
    from tetris.serve.first_token import EarlyFirstToken

    resolved = resolve_model_config(deployment.model)
    if deployment.decode.executor == "emulated":
        # emulated engines have no tokenizer and no EOS (actors/emulated_decode.py)
        return EarlyFirstToken(None, (), resolved.max_position_embeddings)
    tokenizer = _tokenizer_for(resolved)
    return EarlyFirstToken(tokenizer.decode, tokenizer.eos_token_ids, resolved.max_position_embeddings)


def _tokenizer_for(resolved):
    """The model's tokenizer without its weights (the ingress only tokenizes)."""
    from tetris.model.tokenizer import ByteTokenizer, HFTokenizer

    if resolved.source == "hf":
        return HFTokenizer(resolved.path, bos_token_id=resolved.bos_token_id,
                           eos_token_ids=resolved.eos_token_ids)
    return ByteTokenizer(resolved.vocab_size)


def _unwrap(err: BaseException) -> BaseException:
    """Serve wraps a deployment's exception; the API maps ValueError/Overloaded to 4xx."""
    for cls in (Overloaded, ValueError):
        if isinstance(err, cls):
            if type(err) is cls:
                return err
            if cls is Overloaded:
                return Overloaded(str(err).splitlines()[-1], getattr(err, "retry_after_s", 1.0))
            return ValueError(str(err).splitlines()[-1])
    return err


@serve.deployment(ray_actor_options=_NO_CPU, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    """HTTP (OpenAI API + admin routes) and the Python handle API."""

    def __init__(self, deployment: DeploymentConfig, dispatcher) -> None:
        from tetris.serve.metrics import ServingMetrics

        self.deployment = deployment
        self.dispatcher = dispatcher
        self.backend = _DispatcherBackend(deployment, dispatcher)
        self.metrics = ServingMetrics(deployment.model.name, scheduler=False)

    def __serve_build_asgi_app__(self):
        from tetris.serve.admin import add_admin_routes
        from tetris.serve.api import create_api

        app = create_api(self.backend, metrics=self.metrics,
                         extra_metrics=lambda: self.dispatcher.metrics_text.remote())
        add_admin_routes(app, self.dispatcher)
        return app

    # -- Python handle API ------------------------------------------------------------------
    def _to_generate(self, request: GenerationRequest) -> GenerateRequest:
        import time

        from tetris.serve.api import validate_generation
        from tetris.serve.protocol import ProtocolError

        if request.prompt is not None:
            ids = self.backend.tokenizer.encode(request.prompt, add_bos=True) if request.prompt else []
        else:
            ids = request.prompt_token_ids
        # The edge: from here on the prompt is one int32 buffer (tetris/token_ids.py).
        ids = compact_tokens(ids)
        try:
            validate_generation(self.backend, ids, request.sampling)
        except ProtocolError as e:
            raise ValueError(e.message) from None
        return GenerateRequest(request_id=request.request_id or f"handle-{uuid.uuid4().hex}",
                               prompt_token_ids=ids, sampling=request.sampling,
                               stream=True, arrival_time=time.monotonic())

    async def generate(self, request: GenerationRequest) -> Generation:
        req = self._to_generate(request)
        whole = Transcript()
        async for out in self.backend.generate(req):
            whole.add(out)
        return Generation(request_id=req.request_id, text=whole.text, token_ids=tuple(whole.token_ids),
                          prompt_tokens=len(req.prompt_token_ids), finish_reason=whole.finish_reason)

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        req = self._to_generate(request)
        async for out in self.backend.generate(req):
            yield GenerationDelta(request_id=req.request_id, new_text=out.new_text,
                                  new_token_ids=out.new_token_ids, finished=out.finished,
                                  finish_reason=out.finish_reason)


def build_app(config: DeploymentConfig | str | Path | None = None, *, max_pending: int = 256,
              prefill_check_s: float = PREFILL_CHECK_S):
    """The Serve application for a deployment (a TOML path, a loaded config, or the default).
    ``max_pending``: requests queued before 429s; ``prefill_check_s``: how often prefill
    workers are probed for ones that died idle (0: never)."""
    deployment = config if isinstance(config, DeploymentConfig) else load_deployment(config)
    prefill = PrefillPoolServer.bind(deployment)
    decode = DecodePoolServer.bind(deployment)
    dispatcher = DispatcherServer.bind(deployment, prefill, decode, max_pending,
                                       _check_period(prefill_check_s))
    return Ingress.bind(deployment, dispatcher)


def app_builder(args: dict):
    """Entry point for ``serve run`` config files: ``args: {config: PATH, max_pending: N,
    prefill_check_s: S}``."""
    return build_app(args.get("config"), max_pending=int(args.get("max_pending", 256)),
                     prefill_check_s=float(args.get("prefill_check_s", PREFILL_CHECK_S)))
