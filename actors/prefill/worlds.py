"""The prefill pool's workers and their world, in generations: spawning, probing, replacing.

Lifecycle of a dead worker (``reform``):

1. Whoever finds a worker dead (a chunk, ``heal``, ``connect_receivers``, a world that did not
   form) hands ``reform`` the handle it found dead. The first claims the instance
   (``_replacing``, with the number of plans committed by then); later ones wait for that
   replacement or go on without it.
2. The receivers give up what the dead worker owed them at once (``TransferWiring.forget``).
3. A replacement starts, loads its model, gets the send side and the receivers
   (``_start_replacements``) while chunks go on elsewhere; it waits in ``_ready``.
4. Every worker, the replacements in place, joins a new generation of the world beside the
   chunks it runs (``new_world``, ``joining.form_world``); the receivers learn the new
   senders; only then do new chunks start on it (``in_world``). Each worker leaves the
   generations no chunk runs on any more (``_drop_unused_worlds``).

The chunk driver (``pool.PrefillPool``) asks the keeper for the current world and its workers
(``in_world``), which instances are being replaced (``replacing_held``, ``replacing``,
``replacements_for``), to replace dead workers (``reform``), and to form a new generation with
every worker alive after a ring failed (``new_world([])``).

The Ray calls that join workers to a generation and probe them for dead ones are
``joining.py``'s (``form_world``, ``dead_among``); this module decides when and with whom.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator

import ray

from tetris.actors.placement import Placement, node_map, place_prefill
from tetris.actors.prefill.joining import dead_among, form_world
from tetris.actors.prefill.tp import rank_options
from tetris.actors.prefill.tp_groups import workers_per_instance
from tetris.actors.prefill.wiring import TransferWiring
from tetris.actors.prefill.worker import PrefillWorkerActor
from tetris.config import DeploymentConfig

__all__ = ["WorldKeeper"]

_FORM_ATTEMPTS = 4   # tries to form a new world (each after the workers that died were replaced)
_PROBE_S = 10.0      # how long the workers are probed before a world forms

log = logging.getLogger(__name__)


class WorldKeeper:
    """``num_instances`` prefill workers placed by ``placement`` (default ``prefill.placement``;
    see actors/placement.py), joined in one world (NCCL or gloo: actors/collectives.py) that
    is formed again, in generations, whenever dead workers are replaced; ``node_of`` is their
    node map."""

    def __init__(self, deployment: DeploymentConfig, num_instances: int, node_size: int, *,
                 profile: str, timeout_s: float, placement: str | None,
                 placement_timeout_s: float, wiring: TransferWiring,
                 commits: Callable[[], int]) -> None:
        n = num_instances
        self.deployment = deployment
        self.timeout_s = timeout_s
        self._profile = profile
        self._wiring = wiring
        self._commits = commits   # plans committed so far (the chunk driver's tickets)
        self.workers: list = []
        self.placement: Placement = place_prefill(deployment.prefill, n, mode=placement,
                                                  timeout_s=placement_timeout_s)
        try:
            # Spawn with the bundles' nodes; the workers' own reports then fix the node map.
            self.node_of = tuple(node_map(self.placement.node_ids or ["local"] * n, node_size))
            self.workers = [self._spawn(i) for i in range(n)]
            self.node_ids: tuple[str, ...] = tuple(ray.get(
                [w.ray_node.remote() for w in self.workers], timeout=max(120.0, timeout_s)))
        except BaseException:
            self._release_actors()
            raise
        self.node_of = tuple(node_map(self.node_ids, node_size))
        self._init_generations()
        try:
            dead = form_world(self.workers, 0, self.timeout_s)
            if dead:
                raise RuntimeError(f"prefill workers {sorted(dead)} died while the pool started")
        except BaseException:
            self._release_actors()
            raise

    def _init_generations(self) -> None:
        # The world in generations (actors/prefill/world.py): chunks start on ``_world`` with the
        # workers of ``self.workers`` as read together under ``_world_lock``; ``_running`` counts
        # the chunks on each generation, and every worker has left those below ``_dropped``.
        self._world = 0
        self._world_lock = threading.Lock()
        self._forming = threading.Lock()   # one new generation at a time
        self._running: collections.Counter[int] = collections.Counter()
        self._dropped = 0
        self._next_world = 1   # a failed attempt's generation is never used again
        self.replacements = 0          # dead workers replaced so far
        # instance -> set once its replacement is in (one replacement per dead worker, however
        # many threads find it dead)
        self._replacing: dict[int, threading.Event] = {}
        self._found_dead_after: dict[int, int] = {}   # instance -> plans committed when found dead
        self._ready: dict[int, object] = {}   # instance -> its started replacement, not yet in
        self._replacing_lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self.workers)

    # -- what the chunk driver asks -----------------------------------------------------------
    @contextlib.contextmanager
    def replacing_held(self) -> Iterator[Collection[int]]:
        """The instances whose workers are being replaced, held: no worker is marked dead or
        swapped in until the block ends (``PrefillPool.commit`` refuses or commits a plan
        atomically with ``reform`` marking workers dead)."""
        with self._replacing_lock:
            yield self._replacing.keys()

    def replacing(self) -> list[int]:
        """The instances whose workers are being replaced now."""
        with self._replacing_lock:
            return sorted(self._replacing)

    def replacements_for(self, number: int, later: Iterable[int],
                         members: Iterable[int]) -> tuple[list[int], list[threading.Event]]:
        """Read together: the instances of ``later`` being replaced whose worker was found dead
        once plan ``number`` (its commit number) had been committed, and the replacements under
        way of ``members`` (each event is set once its replacement is in)."""
        with self._replacing_lock:
            blind = sorted(i for i in later if i in self._replacing
                           and number <= self._found_dead_after[i])
            pending = [self._replacing[i] for i in members if i in self._replacing]
        return blind, pending

    @contextlib.contextmanager
    def in_world(self):
        """The generation and the worker handles a chunk starting now runs with."""
        with self._world_lock:
            world, workers = self._world, list(self.workers)
            self._running[world] += 1
        try:
            yield world, workers
        finally:
            with self._world_lock:
                self._running[world] -= 1
                if not self._running[world]:
                    del self._running[world]
            self._drop_unused_worlds()

    def _drop_unused_worlds(self) -> None:
        """Every worker leaves the generations older than the oldest one still in use."""
        with self._world_lock:
            oldest = min([self._world, *self._running])
            if oldest <= self._dropped:
                return
            self._dropped, workers = oldest, list(self.workers)
        with self._replacing_lock:   # a dead worker, not yet replaced, holds no world anyway
            skip = set(self._replacing)
        for i, w in enumerate(workers):   # not waited for: a live worker answers soon
            if i not in skip:
                w.drop_worlds.remote(oldest)

    # -- generations --------------------------------------------------------------------------
    def _spawn(self, i: int):
        # Placement options reserve no CPU for the actor itself (num_cpus=0): workers mostly
        # wait on each other; a bundle, when there is one, holds the instance's reservation.
        # A TP instance's rank 0 starts its other ranks in its bundle (actors/prefill/tp.py).
        opts, tp = self.placement.options(i), workers_per_instance(self.deployment.prefill)
        return PrefillWorkerActor.options(**rank_options(opts, tp)).remote(
            i, self.node_of[i], self.deployment.model, self.deployment.prefill,
            profile=self._profile, instance_options=opts if tp > 1 else None)

    def new_world(self, mine: list[int]) -> dict:
        """Swap the started replacements in (``_ready``: instance -> worker, ``mine`` among
        them) and start new chunks on a new generation of the world formed with them. Chunks
        running meanwhile finish on their own generation; nothing waits for them. Returns the
        replacements this call swapped in: every one ready, other threads' too (they then
        find theirs in and return ``{}``). With ``mine`` empty (a ring timed out with every
        worker alive) a new generation is formed regardless.

        A worker can die while the world forms (the others then wait for it in vain): the
        attempt ends, a dead current worker is handed to ``reform`` (its own replacement
        thread, or the one already under way), a dead replacement is started again here, and
        the world forms again once they are ready."""
        for attempt in range(1, _FORM_ATTEMPTS + 1):
            with self._forming:
                with self._replacing_lock:
                    ready = dict(self._ready)
                if mine and not any(i in ready for i in mine):
                    return {}   # another thread swapped them in with its own
                with self._world_lock:
                    workers, generation = list(self.workers), self._next_world
                    self._next_world += 1
                for i, w in ready.items():
                    workers[i] = w
                try:
                    # A worker already dead would keep the others waiting for the whole
                    # timeout: probe first (``alive`` answers beside a chunk).
                    dead = (dead_among(workers, _PROBE_S)
                            or form_world(workers, generation, self.timeout_s))
                except Exception as e:  # noqa: BLE001 - a slow machine: try again
                    log.warning("forming world %d (attempt %d): %s", generation, attempt, e)
                    continue
                if not dead:
                    # The receivers learn the new senders before any chunk can run on them
                    # (a chunk streams as soon as it starts; a receiver that still knew the
                    # instance as dead would leave its KV waiting for the stall timeout).
                    self._wiring.restore(ready)
                    with self._world_lock:
                        self.workers = workers
                        self._world = generation
                    # Swapped in: no longer being replaced, counted, and the waiters let go,
                    # all at once (a reader never sees a worker in and still "replacing").
                    with self._replacing_lock:
                        for i in ready:
                            self._ready.pop(i, None)
                            self._found_dead_after.pop(i, None)
                            done = self._replacing.pop(i, None)
                            if done is not None:
                                done.set()
                        self.replacements += len(ready)
                    self._drop_unused_worlds()
                    return ready
            log.warning("prefill workers %s died while world %d formed (attempt %d)",
                        sorted(dead), generation, attempt)
            self._replace_dead_while_forming(dead, ready)
        raise RuntimeError(f"the world did not form in {_FORM_ATTEMPTS} attempts")

    def _replace_dead_while_forming(self, dead: dict, ready: dict) -> None:
        """Have every worker found dead while a world formed replaced, and wait (bounded) until
        each has a started replacement in ``_ready``."""
        again = [i for i, h in dead.items() if ready.get(i) is h]   # a replacement died
        current = {i: h for i, h in dead.items() if i not in again}
        if current:
            self.reform(current, wait=False)
        if again:
            with self._replacing_lock:
                for i in again:
                    self._ready.pop(i, None)
            new = self._start_replacements(again)
            with self._replacing_lock:
                self._ready.update(new)
        deadline = time.monotonic() + max(120.0, self.timeout_s)
        while time.monotonic() < deadline:
            with self._replacing_lock:
                # ready to be swapped in, or swapped in already by another thread
                if all(i in self._ready or i not in self._replacing for i in dead):
                    return
            time.sleep(0.1)

    # -- replacement --------------------------------------------------------------------------
    def reform(self, dead: dict, *, wait: bool = True) -> None:
        """Form the world again with the dead workers (instance -> the handle found dead)
        replaced; with ``wait=False`` the replacement goes on in a thread of its own.

        The replacements start, load their model and get the send side and the current
        receivers while chunks go on elsewhere (a real model takes tens of seconds to load,
        and the whole pool used to wait for it); then every worker joins a new generation of
        the world beside the chunks it runs, and new chunks start on it (the pool never
        stops: running chunks finish on the old generation). Each dead worker is
        replaced once: a thread that finds one already being replaced waits for that
        replacement instead (unless ``wait=False``); a chunk on it meanwhile is lost or
        waits before it starts (``PrefillPool._await_replacements``). A receiver the
        replacements cannot reach is left to its owner to reconnect."""
        with self._replacing_lock:
            current = {i: h for i, h in dead.items() if self.workers[i] is h}
            mine = sorted(i for i in current if i not in self._replacing)
            theirs = [self._replacing[i] for i in current if i in self._replacing]
            for i in mine:
                self._replacing[i] = threading.Event()
                self._found_dead_after[i] = self._commits()
        if mine:
            log.warning("prefill workers %s are dead: replacing them", mine)
        if dead and not mine:
            if wait:
                for done in theirs:   # replaced, or being replaced, by another thread
                    done.wait(timeout=max(120.0, self.timeout_s))
            return
        if wait or not mine:
            self._replace(mine)
            return
        thread = threading.Thread(target=self._replace_logged, args=(mine,), daemon=True,
                                  name=f"prefill-replace-{'-'.join(map(str, mine))}")
        thread.start()

    def _replace_logged(self, mine: list[int]) -> None:
        try:
            self._replace(mine)
        except Exception as e:  # noqa: BLE001 - a thread of its own: nobody else would see it
            log.error("replacing prefill workers %s failed: %s: %s", mine, type(e).__name__, e)

    def _replace(self, mine: list[int]) -> None:
        """Replace the workers of ``mine`` (claimed by ``reform``) and form the world again."""
        with self._replacing_lock:
            claims = {i: self._replacing[i] for i in mine}
        try:
            # The receivers give up what the dead workers owed them now, not once the
            # replacements are in: no peer under those ids until then.
            self._wiring.forget(mine)
            t0 = time.perf_counter()
            new = self._start_replacements(mine)
            with self._replacing_lock:
                self._ready.update(new)
            t1 = time.perf_counter()
            swapped = self.new_world(mine)
            if swapped:
                log.warning("prefill workers %s replaced: %.1f s to start them, %.1f s to form "
                            "world %d, while the pool ran", sorted(swapped), t1 - t0,
                            time.perf_counter() - t1, self._world)
        except BaseException:
            with self._replacing_lock:   # started and never swapped in: not to be leaked
                unused = [self._ready.pop(i) for i in mine if i in self._ready]
            for w in unused:
                ray.kill(w)
            raise
        finally:
            # Claims a swap has not ended (a failure): ended here. A claim of a later death of
            # the same instance is another event and stays.
            with self._replacing_lock:
                for i, done in claims.items():
                    if self._replacing.get(i) is done:
                        self._found_dead_after.pop(i, None)
                        del self._replacing[i]
                    done.set()

    def _start_replacements(self, instances: list[int]) -> dict:
        """instance -> a new worker that has answered (model loaded), with the send side on
        and the receivers connected; none is used yet."""
        new = {i: self._spawn(i) for i in instances}
        timeout = max(120.0, self.timeout_s)
        try:
            ray.get([w.alive.remote() for w in new.values()], timeout=timeout)
            self._wiring.prepare(new)
        except BaseException:
            for w in new.values():
                ray.kill(w)
            raise
        return new

    def heal(self, timeout_s: float = 10.0) -> list[int]:
        """Replace the workers that died since a chunk last ran on them; returns their instances.

        A chunk finds a dead member itself, but a worker may die with no chunk to run: its
        instance would then keep a dead actor until the next plan lands on it, and the KV it
        was still streaming would be waited for until the receivers' stall timeout. Probing
        every worker (``alive`` answers beside a running chunk) and replacing the dead ones
        tells the receivers too (``TransferWiring.restore``), and they give up the dead worker's
        shards at once. A worker that does not answer within ``timeout_s`` but is not known dead
        is left alone."""
        dead = dead_among(list(self.workers), timeout_s)
        if dead:
            self.reform(dead)
        return sorted(dead)

    def shutdown(self) -> None:
        """Wait for the replacements under way, then stop every worker and free the placement."""
        with self._replacing_lock:
            pending = list(self._replacing.values())
        for done in pending:   # a replacement under way swaps its worker in, then all go
            done.wait(timeout=max(120.0, self.timeout_s))
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=30)
        finally:
            self._release_actors()

    def _release_actors(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self.placement.remove()

