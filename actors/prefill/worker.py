"""The prefill worker: one Ray actor per prefill instance of the SP pool.

The pool's workers form a world (``join_world``, in generations: ``actors/prefill/world.py``); a
chunk's ring and its cache balancing use point-to-point operations on the generation the chunk
names, between the chunk's members only. A new generation is joined on a thread of its own
(the ``"world"`` concurrency group) while a chunk runs on an older one. A worker runs one chunk
at a time (the actor's default concurrency group has one thread); the pool starts the chunks
of every instance in commit order, and every chunk's messages carry their own tags, so rings of
different requests never mix.

TP > 1 (``prefill.tp_size``, a real model): this actor is the instance's TP rank 0 and starts
the other ranks itself; every call that touches KV or the world runs on all of them
(``actors/prefill/tp.py``).

KV streaming (``enable_transfer``): the worker owns a ``SendManager`` on a NIXL agent
``prefill-<instance>``, driven by a ``TransferPump`` thread. Control messages from the decode
ranks arrive through ``deliver_transfer``, a method of the ``"transfer"`` concurrency group, so
grants are handled while a chunk computes. The pump's events are recorded per request
(``transfer_state``); ``release`` forgets finished shards (those still on the wire are
forgotten when they finish), ``abort`` cancels unfinished ones and tells their receivers.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import msgspec
import ray
import torch

from tetris.actors.prefill.executor import ModelExecutor
from tetris.actors.prefill.kv_store import PagedKVStore
from tetris.actors.prefill.messages import ChunkResult, ChunkTask
from tetris.actors.prefill.send_side import SendSide
from tetris.actors.prefill.tp import Followers, start_followers
from tetris.actors.prefill.tp_groups import (SliceWorld, concat_heads, join_instance_group,
                                             merge_states, own_receivers, workers_per_instance)
from tetris.actors.prefill.world import World
from tetris.actors.transfer_pump import TRANSFER_GROUP
from tetris.config import ModelConfig, PrefillConfig, TransferConfig
from tetris.transfer.messages import AgentInfo, ControlMessage

log = logging.getLogger(__name__)

__all__ = ["PrefillWorker", "PrefillWorkerActor", "WORLD_GROUP"]

WORLD_GROUP = "world"   # the actor's concurrency group that joins and drops worlds


class PrefillWorker:
    """Wraps an executor (real model or emulated) and the instance's KV store."""

    def __init__(self, instance: int, node: int, model_cfg: ModelConfig,
                 prefill_cfg: PrefillConfig, *, profile: str | None = None,
                 threads: int = 1, tp_rank: int = 0,
                 tp_leader: tuple[str, int] | None = None,
                 instance_options: dict | None = None) -> None:
        # Several workers share few cores: one intra-op thread each avoids oversubscription.
        # (torch.set_num_threads sizes the pool torch uses; the process's OMP_NUM_THREADS,
        # read when OpenMP started, is not changed by writing it now)
        torch.set_num_threads(threads)
        self.instance = instance
        self.node = node
        self.store: PagedKVStore | None = None
        self.streaming: SendSide | None = None
        self._busy = False   # a chunk call is running (guards the one-chunk-at-a-time rule)
        self._worlds: dict[int, World] = {}   # generation -> the world joined (world.py)
        self._world_in_use: int | None = None  # the running chunk's generation
        self._worlds_lock = threading.Lock()   # joins and drops run beside chunks
        self.tp_rank = tp_rank
        self.tp_size = workers_per_instance(prefill_cfg)
        self.tp = Followers(instance, [])   # the other TP ranks, on TP rank 0 (tp.py)
        if prefill_cfg.executor == "emulated":
            from tetris.scheduler.latency import load_profile

            if profile is None:
                raise ValueError("the emulated executor needs a latency profile")
            timing = load_profile(profile)
            if prefill_cfg.emulated_measurements is not None:
                from tetris.scheduler.execution import execution_latency

                timing = execution_latency("measured", timing, prefill_cfg.emulated_measurements)
            from tetris.actors.prefill.emulated_ranges import EmulatedRangeExecutor

            # EmulatedExecutor that also streams elastic decode's KV ranges
            self.executor = EmulatedRangeExecutor(timing, model_cfg, tp_size=prefill_cfg.tp_size)
        else:
            from tetris.actors.device import actor_device, load_model_on_device, prefill_kv_blocks

            group, (device, _cfg) = None, actor_device(model_cfg)
            if tp_leader is not None:   # a follower: TP rank ``tp_rank`` of the instance
                group = join_instance_group(*tp_leader, tp_rank, prefill_cfg.tp_size, device)
            elif self.tp_size > 1:
                self.tp, group = start_followers(instance, node, model_cfg, prefill_cfg,
                                                 profile, threads, device, instance_options)
            # model.device: CUDA when Ray gave this worker a GPU (actors/device.py)
            model, _tok, device = load_model_on_device(model_cfg, tp_group=group)
            # a TP rank's KV blocks fit its own share of the instance's GPUs (prefill_kv_blocks)
            self.store = PagedKVStore(
                model.num_layers, prefill_kv_blocks(prefill_cfg, model, device),
                prefill_cfg.block_size, model.local_num_kv_heads, model.head_dim,
                dtype=model.dtype, device=device,
            )
            self.executor = ModelExecutor(model, self.store)
            self.tp.wait_started()

    @ray.method(concurrency_group=WORLD_GROUP)
    def join_world(self, generation: int, host: str, port: int, world_size: int,
                   timeout_s: float) -> int:
        """Join generation ``generation`` of the pool's world (NCCL or gloo; its store at
        ``host:port``, served by instance 0); every worker of it must call this at the same
        time. Runs beside a chunk, which goes on on its own generation. Returns the rank."""
        with self._worlds_lock:
            if generation in self._worlds:
                raise ValueError(f"prefill instance {self.instance} already joined world {generation}")
        with self.tp.alongside("join_world", generation, host, port, world_size, timeout_s):
            me = self._rank_device()   # the worlds' backend follows it (collectives.py)
            world = (World(generation, host, port, self.instance, world_size, timeout_s,
                           device=me)
                     if self.tp_size == 1 else
                     SliceWorld(generation, host, port, self.instance, world_size, timeout_s,
                                self.tp_rank, device=me))
        with self._worlds_lock:
            self._worlds[generation] = world
        return self.instance

    def _rank_device(self):
        """Where this worker computes: its model's device (the emulated body: the CPU)."""
        from tetris.actors.collectives import rank_device

        return rank_device(self.executor.model.device if self.store is not None else "cpu")

    @ray.method(concurrency_group=WORLD_GROUP)
    def drop_worlds(self, below: int) -> list[int]:
        """Leave every generation older than ``below`` (the pool runs no chunk on them any
        more; the running chunk's own is kept regardless). Returns the ones left."""
        self.tp.submit("drop_worlds", below)   # not waited for, as the pool's own call
        with self._worlds_lock:
            gone = [self._worlds.pop(g) for g in list(self._worlds)
                    if g < below and g != self._world_in_use]
            left = sorted(self._worlds)
        for world in gone:
            world.close()
        return left

    def prepare(self, task: ChunkTask) -> None:
        self._check(task)
        with self._exclusive(task), self.tp.alongside("prepare", task):
            self.tp.note_receivers(task.kv_receivers)
            self.executor.prepare(self._own_share(task))

    def execute(self, task: ChunkTask) -> ChunkResult:
        self._check(task)
        with self._exclusive(task), self.tp.alongside("execute", task, lose_on_error=True):
            with self._worlds_lock:   # kept from a drop until the chunk is done
                link = self._worlds.get(task.world)
                self._world_in_use = task.world
            try:
                if link is None and len(task.group) > 1:   # a chunk of one talks to no one
                    raise RuntimeError(
                        f"prefill instance {self.instance} got chunk {task.chunk_index} of "
                        f"{task.request_id} on world {task.world}, which it has not joined "
                        f"(it has {sorted(self._worlds)})")
                return self.executor.execute(self._own_share(task), link)
            finally:
                self._world_in_use = None

    def _own_share(self, task: ChunkTask) -> ChunkTask:
        """The task as this TP rank runs it: streaming its head slice to its own receivers."""
        if self.tp_size == 1 or not task.kv_receivers:
            return task
        return msgspec.structs.replace(task, kv_receivers=own_receivers(
            task.kv_receivers, self.tp_rank, self.tp_size))

    @contextlib.contextmanager
    def _exclusive(self, task: ChunkTask):
        # Two chunks interleaving on one worker would mix their KV and deadlock their rings; the
        # default concurrency group must stay at one thread (the transfer group is separate).
        if self._busy:
            raise RuntimeError(f"prefill instance {self.instance} got chunk {task.chunk_index} of "
                               f"{task.request_id} while another chunk is running")
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    # -- KV streaming -------------------------------------------------------------------------
    def enable_transfer(self, config: TransferConfig) -> AgentInfo:
        """Start the send side (agent ``prefill-<instance>``); idempotent for the same config."""
        with self.tp.alongside("enable_transfer", config):
            return self._enable_transfer(config)

    def _enable_transfer(self, config: TransferConfig) -> AgentInfo:
        if self.streaming is None:
            name = f"prefill-{self.instance}" + (f"-tp{self.tp_rank}" if self.tp_rank else "")
            self.streaming = SendSide(self.instance, config, name)
            # Both bodies stream: the emulated one with KV of the wire geometry (EMULATION).
            self.executor.pump = self.streaming.pump
        elif self.streaming.config != config:
            raise ValueError(f"transfer on prefill instance {self.instance} is already enabled "
                             "with another config")
        return self.streaming.agent.info()

    def connect_receivers(self, peers: dict) -> list[int]:
        """receiver id -> (actor handle, AgentInfo): agent peers for writes, actors for messages.

        A receiver whose agent cannot be added (its process died since the table was made:
        the transfer library cannot load a dead agent's metadata) is skipped; its owner
        restarts it and connects the workers to the new one. Returns the skipped ids."""
        with self.tp.alongside("connect_receivers", peers) as others:
            skipped = self._connect_receivers(peers)
        return sorted(set(skipped).union(*others))

    def _connect_receivers(self, peers: dict) -> list[int]:
        st = self._streaming()
        skipped = []
        with st.pump.locked():
            for rid in sorted(peers):
                try:
                    st.agent.add_peer(peers[rid][1])
                except Exception as e:  # noqa: BLE001 - one dead receiver must not cut off the rest
                    log.warning("prefill instance %d: receiver %d skipped: %s", self.instance, rid, e)
                    skipped.append(rid)
        st.pump.connect({rid: handle for rid, (handle, _info) in peers.items() if rid not in skipped})
        return skipped

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def deliver_transfer(self, msgs: list[ControlMessage]) -> None:
        mine = self.tp.route(msgs)   # a TP instance's other ranks get theirs (tp.py)
        if mine:
            self._streaming().pump.deliver(mine)

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def transfer_state(self, request_id: str) -> dict:
        """{"shards": held, "unfinished": n, "sent": n, "failed": [reasons]} of the request."""
        mine = ({"shards": 0, "unfinished": 0, "sent": 0, "failed": []}
                if self.streaming is None else self.streaming.state(request_id))
        return merge_states([mine, *self.tp.run("transfer_state", request_id)])

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def alive(self) -> int:
        """The pool's liveness probe: answers while a chunk computes (transfer group). A TP
        instance with a dead rank is lost: this process ends (``Followers.probe``)."""
        self.tp.probe()
        return self.instance

    def _streaming(self) -> SendSide:
        if self.streaming is None:
            raise RuntimeError(f"transfer is not enabled on prefill instance {self.instance}")
        return self.streaming

    def _check(self, task: ChunkTask) -> None:
        if task.instance != self.instance:
            raise ValueError(f"task for instance {task.instance} sent to {self.instance}")

    def abort(self, request_id: str) -> None:
        """Cancel the request's unfinished shards (their receivers are told) and free its KV."""
        if self.streaming is not None:
            self.streaming.abort(request_id)
        with self.tp.alongside("abort", request_id):
            self.executor.abort(request_id)

    def release(self, request_id: str) -> None:
        """The request's KV was handed off (or is no longer needed): free it, forget its shards."""
        if self.streaming is not None:
            self.streaming.release(request_id)
        with self.tp.alongside("release", request_id):
            self.executor.abort(request_id)

    def adopt_prefix(self, source: str, request_id: str, upto: int, prompt_tokens: int = 0,
                     kv_receivers: tuple[int, ...] = ()):
        """Prefix caching: copy ``source``'s KV below position ``upto`` held here to
        ``request_id`` and stream the copy to ``kv_receivers``; returns its positions."""
        if self.store is None:   # EMULATION: positions only, zero KV streamed
            ranges = self.executor.holdings.copy_prefix(source, request_id, upto)
            if ranges and kv_receivers:
                self._streaming()
                self.executor.stream_prefix(request_id, ranges, prompt_tokens, upto,
                                            tuple(kv_receivers))
            return ranges
        with self.tp.alongside("adopt_prefix", source, request_id, upto, prompt_tokens,
                               kv_receivers):
            ranges = self.store.copy_prefix(source, request_id, upto)
            if ranges and kv_receivers:
                from tetris.actors.prefill.prefix import stream_prefix

                mine = (tuple(kv_receivers) if self.tp_size == 1 else
                        own_receivers(tuple(kv_receivers), self.tp_rank, self.tp_size))
                with self._streaming().pump.locked() as mgr:
                    stream_prefix(mgr, self.store, request_id, ranges, prompt_tokens, upto, mine)
        return ranges

    @ray.method(concurrency_group=TRANSFER_GROUP)   # beside the chunk the holder runs
    def export_prefix(self, source: str, upto: int, shares: tuple) -> tuple:
        """Prefix caching, a prefix moved to another group (``prefix_move.py``): ``source``'s
        positions below ``upto`` held here, then its KV inside each share (all TP ranks'
        heads); reads only."""
        from tetris.actors.prefill.prefix_move import export_parts, merge_rank_parts

        with self.tp.alongside("export_prefix", source, upto, shares) as others:
            mine = export_parts(self, source, upto, shares)
        return merge_rank_parts([mine, *others]) if others else mine

    def import_prefix(self, request_id: str, share: tuple, prompt_tokens: int, upto: int,
                      kv_receivers: tuple[int, ...], *parts) -> tuple:
        """Store this instance's ``share`` of a moved prefix from the holders' ``parts`` under
        ``request_id`` and stream it to ``kv_receivers`` (``prefix_move.py``); each TP rank
        keeps its own heads."""
        from tetris.actors.prefill.prefix_move import import_parts

        with self.tp.alongside("import_prefix", request_id, share, prompt_tokens, upto,
                               kv_receivers, *parts):
            return import_parts(self, request_id, share, prompt_tokens, upto,
                                tuple(kv_receivers), parts)

    def export_kv(self, request_id: str):
        """(positions [n], k [L, n, Hkv, D], v [L, n, Hkv, D]) held here, for hand-off or tests."""
        if self.store is None:
            raise RuntimeError("an emulated worker holds no KV")
        with self.tp.alongside("export_kv", request_id) as others:
            mine = self.store.export(request_id)
        return concat_heads([mine, *others]) if others else mine

    def held_requests(self) -> list[str]:
        """Requests with KV or transfer shards still held here."""
        held = set(self.store.requests() if self.store is not None
                   else self.executor.holdings.requests())
        if self.streaming is not None:
            held.update(self.streaming.held())
        for other in self.tp.run("held_requests"):
            held.update(other)
        return sorted(held)

    def free_blocks(self) -> int:
        return self.store.free_blocks if self.store is not None else 0

    def set_fault(self, request_id: str, chunk_index: int, layer: int) -> None:
        """Test hook: fail once when ``request_id``'s chunk reaches ``layer``."""
        self.executor.fault = (request_id, chunk_index, layer)

    def node_index(self) -> int:
        """The node index the pool gave at spawn (its node map may differ, see ``ray_node``)."""
        return self.node

    def ray_node(self) -> str:
        """The Ray node id this worker runs on (the pool's node map is built from these)."""
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group=WORLD_GROUP)   # asked while a chunk runs (world.py)
    def store_address(self) -> tuple[str, int]:
        """(this node's IP, a port free on it): the world's store runs in rank 0, so its
        address must be reachable from every node, which 127.0.0.1 is not."""
        import socket

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def kv_heads(self) -> list[int]:
        """The KV heads each TP rank of the instance holds, in rank order."""
        mine = [self.executor.model.local_num_kv_heads if self.store is not None else 0]
        return mine + [h for other in self.tp.run("kv_heads") for h in other]

    def tp_followers(self) -> list:
        """The actors of TP ranks 1.. of this instance (none for TP 1)."""
        return list(self.tp.handles)

    def shutdown(self) -> None:
        self.tp.shutdown()
        if self.streaming is not None:
            self.streaming.close()
            self.streaming = None
        with self._worlds_lock:   # a drop may run beside this, in the "world" group
            worlds, self._worlds = list(self._worlds.values()), {}
        for world in worlds:
            world.close()


# "transfer": deliver_transfer must run while a chunk computes; "world": a new generation of
# the world is joined while a chunk computes; the default group keeps one thread, so chunks
# still run one at a time.
PrefillWorkerActor = ray.remote(
    concurrency_groups={TRANSFER_GROUP: 1, WORLD_GROUP: 1})(PrefillWorker)
