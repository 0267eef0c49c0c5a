"""Prefill instances with tensor parallelism (TP > 1): an instance is a TP group of workers.

Layout. TP rank ``t`` of every instance holds KV heads slice ``t`` (``Hkv / tp`` heads: the
model's column-parallel q/k/v projections, ``tetris/model/parallel.py``). Attention never
mixes heads, so the ring of a chunk for head slice ``t`` needs only slice ``t`` of the other
members' KV: it runs between the TP ranks ``t`` of the chunk's member instances, and so does
cache balancing. Each generation of the pool's world (``world.py``, ``worlds.py``) is
therefore ``tp`` gloo groups, one per head slice (``SliceWorld``), each ranked by instance as
the TP-1 world is, so the ring and the balancer address their peers exactly as before. The
row-parallel all-reduces of an instance (o_proj, down_proj) run on the instance's own TP
group, the worker process's default group (as a decode instance's, actors/decode/rank.py),
its backend chosen by ``actors/collectives.py``. SP-NTP and SP-TP chunks run per head slice
on the same worlds; SP-TP's reduced rows are then summed over the instance's TP group, the
all-reduce its ``o_proj`` makes under the ring (sptp.py).

Who is who. The pool sees one actor per instance, its TP rank 0, the *leader*: the pool's
code (chunk driver, generations, replacement, node map) is the same for every TP size. The
leader starts the other ranks (*followers*) itself, in its own placement bundle (on its node
without one), each rank with ``1/tp`` of the instance's GPUs (``rank_options``); started by
it, they share its fate: Ray kills the actors an actor started when it dies. Every call the
pool makes that touches KV or the world (prepare, execute, join/drop a world, abort,
release, export, prefix copy) is run by the leader on itself and on every follower
(``Followers``).

A lost TP rank loses the instance. A dead follower, or a chunk that failed inside an
instance (its ranks may then stand at different all-reduces of a group gloo cannot resume),
makes the leader end its process; the pool then finds the instance dead, as for a TP-1
worker, and replaces it: the new leader starts new followers and joins the next world. A
failed chunk therefore costs each of its TP member instances a replacement (TP 1 keeps its
workers and forms a new world).

KV streaming. Decode receiver ``j`` of ``R`` (a decode instance's TP ranks, in order) takes KV
heads ``[j·Hkv/R, (j+1)·Hkv/R)``; with ``R`` a multiple of ``T`` those lie in one prefill TP
rank's slice, so TP rank ``t`` streams to receivers ``[t·R/T, (t+1)·R/T)``
(``tp_groups.own_receivers``) its own heads, split as a TP-1 member splits all of them. Every rank has its own agent and send
manager under the instance's sender id, so a receiver sees one sender per instance, as with TP
1. The receivers' messages reach the leader (the actor they know), which routes each to the
rank streaming to that receiver, and one that names no receiver to every rank
(``Followers.route``); the send manager ignores what is not its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

import ray
from tetris.actors.prefill.tp_groups import join_instance_group

__all__ = ["Followers", "rank_options", "start_followers"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0     # followers started and their model loaded
_PROBE_S = 10.0              # a follower's liveness probe


def _free_address() -> tuple[str, int]:
    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def rank_options(instance_options: dict, tp_size: int, node_id: str | None = None) -> dict:
    """One TP rank's actor options from its instance's (``Placement.options``): the same
    bundle, ``1/tp_size`` of the instance's GPUs (``prefill.gpus_per_instance``: one GPU per
    rank by default on CUDA, a fraction where several ranks share one). A follower with no
    bundle (placement "none") is pinned to its leader's node ``node_id``."""
    opts = dict(instance_options)
    if opts.get("num_gpus"):
        opts["num_gpus"] = opts["num_gpus"] / tp_size
    if node_id is not None and "scheduling_strategy" not in opts:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return opts


def start_followers(instance: int, node: int, model_cfg, prefill_cfg, profile, threads: int,
                    device: str, instance_options: dict | None = None):
    """On the leader (computing on ``device``): start TP ranks ``1..tp-1`` in its bundle (or
    on its node) and form the instance's TP group with them. Returns (``Followers``, the
    group); the caller loads its model shard then and calls ``Followers.wait_started``."""
    from tetris.actors.prefill.worker import PrefillWorkerActor
    from tetris.actors.process_env import runtime_env

    tp = prefill_cfg.tp_size
    node_id = ray.get_runtime_context().get_node_id()
    host, port = _free_address()
    opts = rank_options(instance_options or {"num_cpus": 0, "runtime_env": runtime_env()},
                        tp, node_id)
    handles = [PrefillWorkerActor.options(**opts).remote(
        instance, node, model_cfg, prefill_cfg, profile=profile, threads=threads,
        tp_rank=t, tp_leader=(host, port)) for t in range(1, tp)]
    group = join_instance_group(host, port, 0, tp, device)
    return Followers(instance, handles), group


class Followers:
    """The leader's view of its instance's other TP ranks (none for TP 1: every call is then
    a no-op, so the worker's code reads the same for every TP size)."""

    def __init__(self, instance: int, handles: list) -> None:
        self.instance = instance
        self.handles = list(handles)
        self._route: dict[int, int] = {}   # receiver id -> the TP rank streaming to it

    @property
    def tp_size(self) -> int:
        return len(self.handles) + 1

    def note_receivers(self, receivers: tuple[int, ...]) -> None:
        """Remember which rank streams to each of a chunk's receivers (``route``)."""
        if self.handles and receivers and len(receivers) % self.tp_size == 0:
            k = len(receivers) // self.tp_size
            for j, r in enumerate(receivers):
                self._route[r] = j // k

    def route(self, msgs: list) -> list:
        """Send the followers their share of the receivers' messages; returns the leader's.
        A message naming a receiver goes to the rank streaming to it, any other to every
        rank (a send manager ignores grants and errors of shards it does not hold)."""
        if not self.handles:
            return list(msgs)
        parts: list[list] = [[] for _ in range(self.tp_size)]
        for m in msgs:
            t = self._route.get(getattr(m, "receiver_id", -1))
            for part in ([parts[t]] if t is not None else parts):
                part.append(m)
        for h, part in zip(self.handles, parts[1:]):
            if part:
                h.deliver_transfer.remote(part)
        return parts[0]

    def wait_started(self) -> None:
        if self.handles:
            self.gather(self.submit("alive"), timeout_s=_START_TIMEOUT_S)

    def submit(self, method: str, *args) -> list:
        return [getattr(h, method).remote(*args) for h in self.handles]

    def gather(self, refs: list, timeout_s: float | None = None) -> list:
        """The followers' answers; a dead follower loses the instance (``instance_lost``)."""
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.RayActorError as e:
            self.instance_lost(f"a TP rank died: {e}")
            raise   # not reached

    def run(self, method: str, *args) -> list:
        return self.gather(self.submit(method, *args))

    @contextlib.contextmanager
    def alongside(self, method: str, *args, lose_on_error: bool = False):
        """Run ``method`` on every follower while the body runs it on the leader; yields the
        list the followers' answers are put in once the body is done. With ``lose_on_error``
        (a chunk's execute) a failure on any rank loses the instance: the ranks may stand at
        different all-reduces. Otherwise (no communication: prepare, abort) the leader's error
        wins and the followers' calls, queued in order on each, are not waited for."""
        if not self.handles:
            yield []
            return
        refs = self.submit(method, *args)
        watch = _Watch(self, refs) if lose_on_error else None
        answers: list = []
        try:
            yield answers
        except BaseException as e:
            if lose_on_error:
                self.instance_lost(f"{method} failed on TP rank 0: {type(e).__name__}: {e}")
            raise
        try:
            answers.extend(self.gather(refs))
        except Exception as e:
            if lose_on_error:
                self.instance_lost(f"{method} failed on a TP rank: {type(e).__name__}")
            raise
        finally:
            if watch is not None:
                watch.stop()

    def probe(self) -> None:
        """Lose the instance if a follower is dead (a slow one is left alone)."""
        if not self.handles:
            return
        refs = self.submit("alive")
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_PROBE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self.instance_lost(f"a TP rank died: {e}")

    def instance_lost(self, why: str) -> None:
        """End the leader's process: the pool finds the instance dead and replaces it; Ray ends
        the followers with it."""
        log.error("prefill instance %d (TP %d) is lost: %s", self.instance, self.tp_size, why)
        for h in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(h)
        os._exit(1)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            ray.get(self.submit("shutdown"), timeout=30)
        for h in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(h)
        self.handles = []


class _Watch:
    """While the leader computes its share of a chunk, a follower that fails ends the instance
    at once, instead of the leader waiting at its next all-reduce for the group's timeout."""

    def __init__(self, followers: Followers, refs: list) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(followers, list(refs)),
                                        daemon=True, name=f"tp-watch-{followers.instance}")
        self._thread.start()

    def _run(self, followers: Followers, refs: list) -> None:
        while refs and not self._stop.is_set():
            ready, refs = ray.wait(refs, num_returns=1, timeout=0.5)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - any failure breaks the group
                    if not self._stop.is_set():
                        followers.instance_lost(f"a TP rank failed mid-chunk: {type(e).__name__}")

    def stop(self) -> None:
        self._stop.set()
