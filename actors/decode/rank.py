"""One TP rank of a decode instance: a Ray actor with an ``LLMEngine`` replica and a receive manager.

Lifecycle of a rank (driven by ``DecodeInstance``):

1. ``init_group``: join the instance's own world (tp_size ranks; none for TP 1; NCCL or gloo
   by ``actors/collectives.py``; CUDA graphs or eager by ``engine/graph_mode.py``) and load
   the TP-sharded model; rank r's cache holds KV heads ``[r*h, (r+1)*h)``, h = Hkv / tp_size.
2. ``enable_transfer``: a NIXL agent ``decode-<receiver_id>`` and a receive manager over the
   engine's cache, driven by a ``TransferPump`` thread; ``connect_senders`` names the prefill
   workers it answers. Senders' control messages arrive through ``deliver_transfer`` (Ray
   concurrency group ``"transfer"``, so they are handled while a decode step computes).
3. ``round(commands)`` every round, on rank 0 only: ``step`` (apply the driver's commands
   (``rank_commands.py``), run one engine step, report outputs (rank 0), the requests whose
   KV completed or failed here, and the engine's stats) on every rank; rank 0 hands the
   commands to the other ranks and collects their replies over a socket to each
   (``lockstep.py``), so a round is one Ray call whatever the TP size.

Every rank applies the same commands in the same order, so all engine replicas make the same
decisions (lockstep); only transfer events differ between ranks, and the driver combines them.

EMULATION (``decode.executor = "emulated"``): ``init_group`` loads no model and forms no group;
the engine is an ``EmulatedDecodeEngine`` (real batching and block bookkeeping, steps that
sleep the decode latency model's time for the deployment's TP size, placeholder tokens) and the
receive manager runs over its storage-free cache. ``control_counts`` reports the Ray calls and
transfer messages this rank saw (the fidelity benchmark's control-plane cost).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import msgspec
import ray
import torch
import torch.distributed as dist

from tetris.actors.decode.counts import ControlCounts, CountingPeer
from tetris.actors.decode.elastic import ElasticMember
from tetris.actors.decode.lockstep import Follower, Leader
from tetris.actors.decode.messages import (Command, Failed, FirstTokenArrived, RankHeld, Rejected,
                                           StepReply)
from tetris.actors.decode.rank_commands import RankCommands
from tetris.actors.decode.rank_kunserve import KunServeRank
from tetris.actors.transfer_pump import TRANSFER_GROUP, TransferPump
from tetris.config import DeploymentConfig, TransferConfig
from tetris.engine.engine import EngineStats, LLMEngine
from tetris.engine.request import OutputDelta, TokenLogprob
from tetris.transfer.messages import AgentInfo, ControlMessage
from tetris.transfer.states import (FirstTokenIn, MessageRejected, RequestReady, TransferEvent,
                                   TransferFailed)

__all__ = ["DecodeRank", "DecodeRankActor", "EngineBlocks"]

log = logging.getLogger(__name__)


_HELD_FOR_WRITES = "<held for direct writes>"


class EngineBlocks:
    """The receive manager's allocator, backed by blocks the engine has already reserved.

    The engine owns a request's blocks from ``reserve`` until it finishes or is aborted, so the
    receive manager only borrows them: ``allocate`` hands out the table set by ``lend`` (only
    during that reservation; any other handshake finds no blocks and is rejected) and ``free``
    gives nothing back.
    """

    def __init__(self) -> None:
        self._lent: list[int] | None = None
        # Direct writes (transfer/direct.py): blocks of aborted requests that a granted write
        # may still land in, kept from the engine until the receive manager lets them go.
        # Touched under the pump's lock only (withhold and return_released on the step thread).
        self._withheld: set[int] = set()
        self._released: list[int] = []

    def lend(self, block_table: list[int] | None) -> None:
        self._lent = None if block_table is None else list(block_table)

    def allocate(self, num_blocks: int) -> list[int] | None:
        if self._lent is None or num_blocks > len(self._lent):
            return None
        return self._lent[:num_blocks]

    def free(self, blocks) -> None:
        return None

    def withhold(self, engine_blocks, held) -> None:
        """After the engine freed an aborted request's blocks: keep ``held`` (the receive
        manager's ``held_back``) out of circulation."""
        got = engine_blocks.withhold(_HELD_FOR_WRITES, held)
        self._withheld.update(got)
        self._released = [b for b in self._released if b not in got]   # stale releases

    def release_held(self, blocks) -> None:
        """The receive manager's hold ended (every write landed or timed out); pump thread."""
        self._released += [b for b in blocks if b in self._withheld]

    def return_released(self, engine_blocks) -> None:
        """Hand released blocks back to the engine (step thread)."""
        blocks, self._released = self._released, []
        self._withheld.difference_update(blocks)
        engine_blocks.free_owned(_HELD_FOR_WRITES, blocks)


class DecodeRank(KunServeRank, RankCommands):
    def __init__(self, instance: int, tp_rank: int, tp_size: int, deployment: DeploymentConfig,
                 *, seed: int = 0, threads: int = 1) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside a TP group of {tp_size}")
        # Several ranks share few cores: one intra-op thread each avoids oversubscription.
        # (torch.set_num_threads sizes the pool torch uses; the process's OMP_NUM_THREADS,
        # read when OpenMP started, is not changed by writing it now)
        torch.set_num_threads(threads)
        self.instance = instance
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.deployment = deployment
        self.seed = seed
        self.receiver_id = instance * tp_size + tp_rank
        self.engine: LLMEngine | None = None
        self.pump: TransferPump | None = None
        self.agent = None
        self._blocks = EngineBlocks()
        self._events_lock = threading.Lock()
        self._ready: list[str] = []
        self._failed: list[Failed] = []
        self._first: list[FirstTokenArrived] = []
        self._counts = ControlCounts()
        # a rank > 0 steps on a thread of its own (``Follower``) while Ray calls (``held``,
        # ``stats``) come on the actor's: one step or read at a time
        self._step_lock = threading.Lock()
        self._leader: Leader | None = None
        self._follower: Follower | None = None
        self.elastic: ElasticMember | None = None   # once joined (actors/decode/elastic.py)
        self.kept = None   # engine/kept_kv.py's KeptKV: prefix caching's decode side

    # -- setup ----------------------------------------------------------------------------
    def rendezvous(self) -> tuple[str, int]:
        """(host, port) for the group's store, on this rank's node (called on rank 0)."""
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def init_group(self, host: str, port: int, timeout_s: float,
                   lockstep_timeout_s: float | None = None) -> int:
        """Form the instance's TP world (all ranks at once; NCCL or gloo, chosen by
        ``actors/collectives.py``), load the sharded model and
        connect the lockstep (``lockstep.py``; rank 0 waits ``lockstep_timeout_s`` for a
        follower's reply)."""
        from tetris.actors.collectives import form_tp_group, rank_device
        from tetris.actors.device import actor_device

        if self.deployment.decode.executor == "emulated":
            return self._init_emulated()
        group = backend = None
        if self.tp_size > 1:
            if dist.is_initialized():
                dist.destroy_process_group()
            # NCCL or gloo, the same on every rank: chosen from every rank's device
            backend = form_tp_group(host, port, self.tp_rank, self.tp_size, timeout_s,
                                    rank_device(actor_device(self.deployment.model)[0]))
            group = dist.group.WORLD
        self.engine = self._new_engine(group, backend)
        if group is not None:
            dist.barrier()
            wait_s = lockstep_timeout_s or timeout_s
            if self.tp_rank == 0:
                self._leader = Leader.open(host, self.tp_size, self.step, wait_s)
            else:
                self._follower = Follower.open(self.tp_rank, self.step, wait_s)
        return self.engine.model.local_num_kv_heads

    def _new_engine(self, group=None, backend: str | None = None) -> LLMEngine:
        """The model loaded from its checkpoint (TP-sharded over ``group``) and an engine over
        it; also how a KunServe survivor becomes a whole replica again (rank_kunserve.py)."""
        from tetris.actors.device import decode_kv_blocks, load_model_on_device

        from tetris.engine.graph_mode import decode_graph_mode

        # model.device: CUDA when Ray gave this rank a GPU (actors/device.py, docs/gpu.md)
        model, tokenizer, device = load_model_on_device(self.deployment.model, tp_group=group)
        dc = self.deployment.decode
        mode = decode_graph_mode(device, self.tp_size, backend)   # engine/graph_mode.py
        log.info("decode instance %d TP rank %d: %s", self.instance, self.tp_rank, mode.reason)
        return LLMEngine(model, tokenizer, num_blocks=decode_kv_blocks(dc, model, device),
                         block_size=dc.block_size, max_num_seqs=dc.max_batch_size,
                         seed=self.seed, cuda_graphs=mode.cuda_graphs)

    def _init_emulated(self) -> int:
        """EMULATION: no model, no group. The engine's latency is the deployment's TP size
        even when one rank actor stands for the whole instance (``tp_size`` 1 here)."""
        from tetris.actors.decode.emulated import EmulatedDecodeEngine

        mc = self.deployment.model
        if mc.num_kv_heads % self.tp_size:
            raise ValueError(f"{mc.num_kv_heads} KV heads cannot be split over {self.tp_size} ranks")
        heads = mc.num_kv_heads // self.tp_size
        self.engine = EmulatedDecodeEngine(self.deployment, tp_size=self.deployment.decode.tp_size,
                                           kv_heads=heads,
                                           time_scale=_time_scale(self.deployment))
        return heads

    def join_elastic(self, index: int, size: int, host: str, port: int, timeout_s: float,
                     listen_host: str | None = None) -> None:
        """Join the elastic world of rank ``tp_rank`` of every decode instance (instance
        ``index`` of ``size``; instance 0's rank serves the store at ``host:port``; this rank
        listens on ``listen_host``, its node's address by default). Every member calls it at
        once; from then on each round meets the other members (actors/decode/elastic_link.py)."""
        self.elastic = ElasticMember.join(self, index, size, host, port, timeout_s,
                                          listen_host or ray.util.get_node_ip_address())

    def enable_transfer(self, config: TransferConfig) -> AgentInfo:
        from tetris.transfer.backends import make_agent
        from tetris.transfer.receive_manager import ReceiveManager

        engine = self._engine()
        self.agent = make_agent(f"decode-{self.receiver_id}", backend=config.backend, config=config)
        caches = [(engine.cache.k[i], engine.cache.v[i]) for i in range(engine.cache.num_layers)]
        manager = ReceiveManager(self.receiver_id, caches, self._blocks, self.agent, config)
        self.pump = TransferPump(manager, name=f"decode-{self.receiver_id}",
                                 on_events=self._on_transfer_events).start()
        return self.agent.info()

    def connect_senders(self, peers: dict) -> None:
        # Counted on the way out: the control-plane cost of streaming, measured not estimated.
        # None: that sender is dead and not yet replaced (what it owed is given up now)
        self._pump().connect({i: None if h is None else CountingPeer(h, self._counts)
                              for i, h in peers.items()})

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def deliver_transfer(self, msgs: list[ControlMessage]) -> None:
        self._counts.received(msgs)
        if self.pump is None:
            log.warning("decode-%d: %d transfer message(s) before enable_transfer; dropped",
                        self.receiver_id, len(msgs))
            return
        self.pump.deliver(msgs)

    def _on_transfer_events(self, events: list[TransferEvent]) -> None:
        # Runs on the pump thread; the next step's reply carries these to the driver.
        with self._events_lock:
            for e in events:
                if isinstance(e, RequestReady):
                    self._request_ready(e.request_id)   # rank_kunserve.py
                elif isinstance(e, TransferFailed):
                    self._failed.append(Failed(e.request_id, e.reason))
                elif isinstance(e, FirstTokenIn):
                    logprob = (msgspec.msgpack.decode(e.logprob, type=TokenLogprob)
                               if e.logprob else None)
                    self._first.append(FirstTokenArrived(e.request_id, e.token, logprob))
                elif isinstance(e, MessageRejected):
                    # the sender fails that shard: worth seeing in the actor's log
                    log.warning("decode-%d: rejected a message of %s from prefill %d: %s",
                                self.receiver_id, e.request_id, e.sender_id, e.reason)

    # -- one round ------------------------------------------------------------------------
    def round(self, commands: list[Command]) -> list[StepReply]:
        """The driver's one call per round (to rank 0): every rank's ``step`` reply, in rank
        order; ``LockstepBroken`` when a rank died or failed its step."""
        self._counts.ray_rounds += 1
        if self._follower is not None:
            raise RuntimeError(f"TP rank {self.tp_rank} follows rank 0: call rank 0's round")
        if self._leader is None:
            return [self.step(commands)]
        return self._leader.round(commands)

    def step(self, commands: list[Command]) -> StepReply:
        with self._step_lock:
            return self._step(commands)

    def _step(self, commands: list[Command]) -> StepReply:
        engine = self._engine()
        self._counts.steps += 1
        if self._blocks._released:   # held-back blocks whose writes settled (direct writes)
            with self.pump.locked():
                self._blocks.return_released(engine.blocks)
        rejected: list[Rejected] = []
        for cmd in commands:
            reason = self._apply(cmd)
            if reason is not None:
                rejected.append(reason)
        # With only RECEIVING requests the plan is empty: no model call, no collective, just
        # the outputs queued by this round's commands (aborts, committed first tokens).
        t0 = time.perf_counter()
        lost: list[Failed] = []
        if self.elastic is not None:   # every round, work or not: peers may ask this rank
            outputs, lost = self.elastic.round()
        else:
            outputs = engine.step() if engine.has_unfinished() else []
        step_s = time.perf_counter() - t0 if outputs else 0.0
        with self._events_lock:
            ready, self._ready = self._ready, []
            failed, self._failed = self._failed + lost, []
            first, self._first = self._first, []
        # deltas, not the engine's cumulative outputs: O(new tokens) per step on the wire
        deltas = [OutputDelta.of(o) for o in outputs] if self.tp_rank == 0 else []
        return StepReply(rank=self.tp_rank, outputs=deltas,
                         ready=ready, failed=failed, rejected=rejected, stats=engine.stats(),
                         step_s=step_s, first_tokens=first)

    # -- introspection --------------------------------------------------------------------
    @ray.method(concurrency_group=TRANSFER_GROUP)
    def control_counts(self) -> dict[str, int]:
        """Ray calls and messages this rank handled: step rounds, transfer calls/messages in
        and out by kind (cumulative)."""
        return self._counts.snapshot()

    def stats(self) -> EngineStats:
        with self._step_lock:
            return self._engine().stats()

    def held(self) -> RankHeld:
        with self._step_lock:
            return self._held()

    def _held(self) -> RankHeld:
        s = self._engine().stats()
        receiving: list[str] = []
        backends: list[int] = []
        if self.pump is not None:
            with self.pump.locked() as manager:
                receiving = sorted(manager.requests)
                backends = [b.backend_id for b in manager.backends
                            if b.holder is not None or b.credits]
        return RankHeld(engine_requests=s.running + s.waiting + s.ready + s.receiving,
                        receiving=receiving, backends_held=backends, free_blocks=s.free_blocks,
                        total_blocks=s.total_blocks,
                        kept=sorted(self.kept.runs) if self.kept is not None else [])

    def shutdown(self) -> None:
        if self._leader is not None:
            self._leader.stop()
            self._leader = None
        if self._follower is not None:
            # rank 0's shutdown (called beside this one) stops the loop; a dead rank 0 ends it
            if not self._follower.join(10.0):
                log.warning("TP rank %d: lockstep loop still waiting at shutdown", self.tp_rank)
            self._follower.close()
            self._follower = None
        if self.pump is not None:
            self.pump.stop()
            with self.pump.locked() as manager:
                manager.close()
            self.pump = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("call init_group before using the decode rank")
        return self.engine

    def _pump(self) -> TransferPump:
        if self.pump is None:
            raise RuntimeError("call enable_transfer before connecting senders")
        return self.pump


def _time_scale(deployment: DeploymentConfig) -> float:
    emulation = getattr(deployment, "emulation", None)
    return 1.0 if emulation is None else float(emulation.time_scale)


DecodeRankActor = ray.remote(concurrency_groups={TRANSFER_GROUP: 1})(DecodeRank)
