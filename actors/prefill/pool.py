"""The driver side of the SP pool: N prefill workers, a gloo world, plans executed chunk by chunk.

Lifecycle of one request (``run``):

1. Reject a broken plan before anything runs: ``PrefillPlan.validate`` (coverage, groups only
   grow, instances inside the pool) and the prompt's length.
2. Derive the KV layout of every chunk (``layout.plan_layout``).
3. Per chunk, in order: every member ``prepare``s (reserves KV slots; no communication), then
   every member ``execute``s (cache balancing + ring attention + MLP, layer by layer).
4. The member holding the last prompt token returns the first output token.
5. On any failure, every member that may hold part of the request frees it, and the caller
   gets a ``PrefillError`` naming the chunk and the worker; the pool keeps serving. A worker
   that died raises ``PrefillWorkerLost`` at once (nothing was wrong with the request, and a
   new plan for it can run at once, around the instance) while its replacement starts in the
   background; once it is in, every worker joins a new generation of the world beside the
   chunks it runs (``actors/prefill/world.py``), so the pool never stops. Meanwhile ``commit``
   refuses a new plan on the instance (``InstanceReplacing``: the planner plans again around
   it), and a chunk there whose plan was committed before the worker was found dead is lost
   at once (``PrefillPlanOutdated``); only a plan its planner insisted on
   (``wait_replacing``) waits for the replacement.
The KV stays on the workers until ``release`` (after hand-off) or ``abort``.

``run`` is thread-safe. Chunks start on each instance in commit order (``commit``, tickets of
``chunk_order``), so concurrent plans on overlapping groups cannot deadlock. With
``enable_transfer``/``connect_receivers`` and ``run(..., kv_receivers=...)`` every member
streams the KV it computes to the decode ranks, layer by layer, while the chunk runs.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import ray

from tetris.actors.placement import PLACEMENT_TIMEOUT_S, Placement, node_map, place_prefill
from tetris.actors.prefill.chunk_order import ChunkTickets
from tetris.actors.prefill.layout import plan_layout
from tetris.actors.prefill.messages import (
    BalanceMode,
    ChunkResult,
    ChunkTask,
    PrefillError,
    PrefillPlanOutdated,
    PrefillResult,
    PrefillWorkerLost,
)
from tetris.actors.prefill.worker import PrefillWorkerActor
from tetris.config import DeploymentConfig, TransferConfig
from tetris.errors import InstanceReplacing
from tetris.plan import PlanError, PrefillPlan
from tetris.sampling_params import SamplingParams
from tetris.token_ids import TokenIds, compact_tokens, token_slices
from tetris.transfer.messages import AgentInfo

__all__ = ["PrefillPool", "free_port"]

_FORM_ATTEMPTS = 4   # tries to form a new world (each after the workers that died were replaced)
_PROBE_S = 10.0      # how long the workers are probed before a world forms

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (the OS picks it); the world's store listens there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PrefillPool:
    """``num_instances`` workers forming one gloo world, placed on Ray nodes by ``placement``
    (default ``prefill.placement``; see actors/placement.py); ``node_of`` is their node map."""

    def __init__(self, deployment: DeploymentConfig, *, num_instances: int | None = None,
                 node_size: int | None = None, profile: str | None = None,
                 timeout_s: float = 60.0, chunk_timeout_s: float = 600.0,
                 balance: BalanceMode = "overlap", placement: str | None = None,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        pc = deployment.prefill
        n = num_instances or pc.num_instances
        per_node = node_size or pc.node_size
        if n % per_node:
            raise ValueError(f"{n} instances cannot be cut into nodes of {per_node}")
        self.deployment = deployment
        self.timeout_s = timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.balance: BalanceMode = balance
        self.emulated = pc.executor == "emulated"
        self._profile = profile or deployment.scheduler.profile
        self.workers: list = []
        self.placement: Placement = place_prefill(pc, n, mode=placement,
                                                  timeout_s=placement_timeout_s)
        try:
            # Spawn with the bundles' nodes; the workers' own reports then fix the node map.
            self.node_of = tuple(node_map(self.placement.node_ids or ["local"] * n, per_node))
            self.workers = [self._spawn(i) for i in range(n)]
            self.node_ids: tuple[str, ...] = tuple(ray.get(
                [w.ray_node.remote() for w in self.workers], timeout=max(120.0, timeout_s)))
        except BaseException:
            self._release_actors()
            raise
        self.node_of = tuple(node_map(self.node_ids, per_node))
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._tickets = ChunkTickets(n)
        # The world in generations (actors/prefill/world.py): chunks start on ``_world`` with the
        # workers of ``self.workers`` as read together under ``_world_lock``; ``_running`` counts
        # the chunks on each generation, and every worker has left those below ``_dropped``.
        self._world = 0
        self._world_lock = threading.Lock()
        self._forming = threading.Lock()   # one new generation at a time
        self._running: collections.Counter[int] = collections.Counter()
        self._dropped = 0
        self._next_world = 1   # a failed attempt's generation is never used again
        self._transfer = None          # TransferConfig once enable_transfer ran
        self._receivers: dict = {}     # receiver id -> (actor handle, AgentInfo)
        self.replacements = 0          # dead workers replaced so far
        # instance -> set once its replacement is in (one replacement per dead worker, however
        # many threads find it dead)
        self._replacing: dict[int, threading.Event] = {}
        self._found_dead_after: dict[int, int] = {}   # instance -> plans committed when found dead
        self._ready: dict[int, object] = {}   # instance -> its started replacement, not yet in
        self._replacing_lock = threading.Lock()
        try:
            dead = self._form_world(self.workers, 0)
            if dead:
                raise RuntimeError(f"prefill workers {sorted(dead)} died while the pool started")
        except BaseException:
            self._release_actors()
            raise

    def _spawn(self, i: int):
        # Placement options reserve no CPU for the actor itself (num_cpus=0): workers mostly
        # wait on each other; a bundle, when there is one, holds the instance's reservation.
        return PrefillWorkerActor.options(**self.placement.options(i)).remote(
            i, self.node_of[i], self.deployment.model, self.deployment.prefill,
            profile=self._profile)

    def _form_world(self, workers: list, generation: int) -> dict[int, object]:
        """Have ``workers`` join generation ``generation`` of the world, its store in worker 0
        on a port free on worker 0's node. Workers join beside the chunks they run.

        Returns the workers found dead meanwhile (instance -> handle; the world is not formed
        then). Every join has ended, one way or the other, before this returns: a worker's
        joins run one at a time, so a join left waiting would make the next attempt's time
        out too. Raises if the world did not form for another reason (a timeout)."""
        timeout = max(120.0, self.timeout_s)
        try:
            host, port = ray.get(workers[0].store_address.remote(), timeout=timeout)
        except ray.exceptions.RayActorError:
            return {0: workers[0]}
        refs = [w.join_world.remote(generation, host, port, len(workers), self.timeout_s)
                for w in workers]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        dead, failed = {}, []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                dead[i] = workers[i]
            except Exception as e:  # noqa: BLE001 - reported together below
                failed.append(f"instance {i}: {type(e).__name__}: {_first_line(e)}")
        if not dead and failed:
            raise RuntimeError(f"world {generation} did not form: {'; '.join(failed[:3])}")
        return dead

    def _new_world(self, mine: list[int]) -> dict:
        """Swap the started replacements in (``_ready``: instance -> worker, ``mine`` among
        them) and start new chunks on a new generation of the world formed with them. Chunks
        running meanwhile finish on their own generation; nothing waits for them. Returns the
        replacements this call swapped in: every one ready, other threads' too (they then
        find theirs in and return ``{}``). With ``mine`` empty (a ring timed out with every
        worker alive) a new generation is formed regardless.

        A worker can die while the world forms (the others then wait for it in vain): the
        attempt ends, a dead current worker is handed to ``_reform`` (its own replacement
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
                    dead = _dead_among(workers, _PROBE_S) or self._form_world(workers, generation)
                except Exception as e:  # noqa: BLE001 - a slow machine: try again
                    log.warning("forming world %d (attempt %d): %s", generation, attempt, e)
                    continue
                if not dead:
                    # The receivers learn the new senders before any chunk can run on them
                    # (a chunk streams as soon as it starts; a receiver that still knew the
                    # instance as dead would leave its KV waiting for the stall timeout).
                    self._restore_transfer(ready)
                    with self._world_lock:
                        self.workers = workers
                        self._world = generation
                    with self._replacing_lock:
                        for i in ready:
                            self._ready.pop(i, None)
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
            self._reform(current, wait=False)
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

    @contextlib.contextmanager
    def _in_world(self):
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

    @property
    def size(self) -> int:
        return len(self.workers)

    def commit(self, plan: PrefillPlan, *, wait_replacing: bool = False) -> list[float]:
        """Fix the plan's place in every member instance's chunk order (call in planning order);
        returns ``busy_for()`` with it committed.

        A plan on an instance whose worker is being replaced is refused (``InstanceReplacing``,
        nothing committed) unless ``wait_replacing``: its planner had not heard yet (the pool
        tells it with each commit), and the plan would hold its other members' turns, and so
        every plan behind it there, until the replacement is in (tens of seconds for a real
        model). The planner plans again with a fresh ``busy_for``."""
        plan.validate(self.size)
        with self._replacing_lock:   # atomic with ``_reform`` marking workers dead
            replacing = sorted({i for c in plan.chunks for i in c.instances} & self._replacing.keys())
            if replacing and not wait_replacing:
                raise InstanceReplacing(
                    f"plan {plan.request_id} uses prefill instances {replacing}, whose workers "
                    "are being replaced; plan it again around them", tuple(replacing))
            self._tickets.commit(plan)
        return self.busy_for()

    def busy_for(self) -> list[float]:
        """Per instance, the seconds of committed work it still has to run (``ChunkTickets.
        busy_for``: the tickets replayed from the chunks running now), infinite while its
        worker is being replaced: what the dispatcher plans on when the pool runs late."""
        busy = self._tickets.busy_for()
        with self._replacing_lock:
            for i in self._replacing:
                busy[i] = float("inf")
        return busy

    def run(self, plan: PrefillPlan, token_ids: Sequence[int], *,
            sampling: SamplingParams | None = None, return_logits: bool = False,
            balance: BalanceMode | None = None, kv_receivers: tuple[int, ...] = (),
            on_chunk_start: Callable[[int], None] | None = None,
            on_chunk_end: Callable[[int, bool], None] | None = None) -> PrefillResult:
        """Execute a plan; returns the first token. Raises PlanError / PrefillError.

        Commits the plan unless ``commit`` did. Each chunk waits for its turn on its members;
        ``on_chunk_start(k)`` runs right before chunk ``k``'s prepare, ``on_chunk_end(k, ok)``
        after its execute (or its failure), both in this thread.
        """
        plan.validate(self.size)
        token_ids = compact_tokens(token_ids)   # no copy for the dispatcher's int32 array
        self._tickets.start(plan)
        try:
            if len(token_ids) != plan.prompt_tokens:
                raise PlanError(f"plan {plan.request_id} is for {plan.prompt_tokens} tokens, "
                                f"the prompt has {len(token_ids)}")
            opts = _RunOptions(balance or self.balance, sampling, return_logits,
                               tuple(kv_receivers), on_chunk_start, on_chunk_end)
            return self._run_chunks(plan, token_ids, opts)
        finally:
            self._tickets.finish(plan.request_id)

    def _run_chunks(self, plan: PrefillPlan, token_ids: TokenIds, opts: "_RunOptions") -> PrefillResult:
        layouts, final = plan_layout(plan, opts.balance)
        waits: list[float] = []   # per chunk, the wait for its turn on its members
        touched: list[int] = []
        results: list[list[ChunkResult]] = []
        try:
            for k, lay in enumerate(layouts):
                w0 = time.perf_counter()
                self._await_replacements(plan, k, wait=False)
                self._tickets.wait_turn(plan.request_id, k, self.chunk_timeout_s)
                waits.append(time.perf_counter() - w0)
                if k == 0:
                    t0 = time.perf_counter()
                touched = sorted(set(touched) | set(lay.group))
                results.append(self._run_chunk(plan, k, lay, token_ids, opts))
        except _ChunkFailed as failed:
            # The failed chunk's tickets stay until the world is whole again (run's finally).
            self._recover(plan.request_id, touched, failed)
            raise failed.error from None
        except BaseException:
            self._abort_quietly(plan.request_id, touched)
            raise
        return self._result(plan, results, final, time.perf_counter() - t0, waits)

    def _run_chunk(self, plan, k, lay, token_ids, opts: "_RunOptions") -> list[ChunkResult]:
        with self._lock:
            seq = next(self._seq)
        if opts.on_chunk_start is not None:
            opts.on_chunk_start(k)
        try:
            self._await_replacements(plan, k)
            with self._in_world() as (world, workers):
                tasks = [self._task(plan, k, r, lay, token_ids, seq, opts, world)
                         for r in range(len(lay.group))]
                handles = [workers[t.instance] for t in tasks]
                self._phase(plan, k, tasks, handles, "prepare")
                out = self._phase(plan, k, tasks, handles, "execute")
        except BaseException:
            if opts.on_chunk_end is not None:
                try:
                    opts.on_chunk_end(k, False)
                except Exception as e:  # noqa: BLE001 - the chunk's own error matters more
                    log.warning("on_chunk_end(%d, False) of %s failed: %s", k, plan.request_id, e)
            raise
        self._tickets.chunk_done(plan.request_id, k)
        if opts.on_chunk_end is not None:
            opts.on_chunk_end(k, True)
        return out

    def _recover(self, request_id: str, touched: list[int], failed: "_ChunkFailed") -> None:
        """Free the request everywhere; after a failure inside a ring, form the world again.

        A gloo wait that times out closes its connection for good, so once a chunk failed
        while its members were communicating, a new generation of the world is formed (dead
        actors replaced) for the chunks that start from then on; chunks already running
        finish on theirs.
        """
        dead = {i: failed.handles[i] for i, err in failed.errors
                if isinstance(err, ray.exceptions.RayActorError)}
        alive = [i for i in touched if i not in dead]
        self._abort_quietly(request_id, alive)
        # A dead worker is replaced whichever phase found it (the first call a dead worker
        # gets is usually ``prepare``); the world, which counted it, is formed again. The
        # request does not wait for the replacement: it is lost, not failed, and the dispatcher
        # plans it again around the instance (``busy_for`` reports it being replaced).
        if dead:
            self._reform(dead, wait=False)
        elif failed.method == "execute" and failed.group_size > 1:
            self._new_world([])

    def _reform(self, dead: dict, *, wait: bool = True) -> None:
        """Form the world again with the dead workers (instance -> the handle found dead)
        replaced; with ``wait=False`` the replacement goes on in a thread of its own.

        The replacements start, load their model and get the send side and the current
        receivers while chunks go on elsewhere (a real model takes tens of seconds to load,
        and the whole pool used to wait for it); then every worker joins a new generation of
        the world beside the chunks it runs, and new chunks start on it (the pool never
        stops: running chunks finish on the old generation). Each dead worker is
        replaced once: a thread that finds one already being replaced waits for that
        replacement instead (unless ``wait=False``); a chunk on it meanwhile is lost or
        waits before it starts (``_await_replacements``). A receiver the replacements cannot
        reach is left to its owner to reconnect."""
        with self._replacing_lock:
            current = {i: h for i, h in dead.items() if self.workers[i] is h}
            mine = sorted(i for i in current if i not in self._replacing)
            theirs = [self._replacing[i] for i in current if i in self._replacing]
            for i in mine:
                self._replacing[i] = threading.Event()
                self._found_dead_after[i] = self._tickets.commits()
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

    def _await_replacements(self, plan: PrefillPlan, k: int, *, wait: bool = True) -> None:
        """Before chunk ``k`` waits for its turn, and again before it starts: if an instance of
        this or a later chunk is being replaced and the plan was committed before that worker was found dead, the run fails at once with
        ``PrefillPlanOutdated`` (it could not plan around it; going on would spend its earlier
        chunks' GPU time on a run that is lost anyway, and waiting would hold every member's
        turn, and so every plan behind it, for as long as a replacement takes). A chunk whose
        plan was committed since (``commit(..., wait_replacing=True)``, or run without a
        commit) waits for its own members' replacements (``wait``)."""
        number = self._tickets.number(plan.request_id) or 0
        later = {i for c in plan.chunks[k:] for i in c.instances}
        while True:
            with self._replacing_lock:
                blind = sorted(i for i in later if i in self._replacing
                               and number <= self._found_dead_after[i])
                pending = [self._replacing[i] for i in plan.chunks[k].instances
                           if i in self._replacing]
            if blind:
                raise PrefillPlanOutdated(
                    f"request {plan.request_id} chunk {k}: prefill instance {blind[0]} "
                    f"(node {self.node_of[blind[0]]}) is being replaced; its worker died after "
                    "the plan was made")
            if not pending or not wait:
                return
            for done in pending:
                if not done.wait(timeout=max(120.0, self.timeout_s)):
                    return   # not replaced in time: the chunk finds the worker as it is

    def _replace(self, mine: list[int]) -> None:
        """Replace the workers of ``mine`` (claimed by ``_reform``) and form the world again."""
        try:
            if mine and self._transfer is not None and self._receivers:
                # The receivers give up what the dead workers owed them now, not once the
                # replacements are in: no peer under those ids until then.
                self._tell_receivers(self._receivers, dict.fromkeys(mine))
            t0 = time.perf_counter()
            new = self._start_replacements(mine)
            with self._replacing_lock:
                self._ready.update(new)
            t1 = time.perf_counter()
            swapped = self._new_world(mine)
            if swapped:
                self.replacements += len(swapped)
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
            with self._replacing_lock:
                for i in mine:
                    self._found_dead_after.pop(i, None)
                    self._replacing.pop(i).set()

    def _start_replacements(self, instances: list[int]) -> dict:
        """instance -> a new worker that has answered (model loaded), with the send side on
        and the receivers connected; none is used yet."""
        new = {i: self._spawn(i) for i in instances}
        timeout = max(120.0, self.timeout_s)
        try:
            ray.get([w.alive.remote() for w in new.values()], timeout=timeout)
            if self._transfer is not None and new:
                ray.get([w.enable_transfer.remote(self._transfer) for w in new.values()],
                        timeout=timeout)
                self._connect_new(new)
        except BaseException:
            for w in new.values():
                ray.kill(w)
            raise
        return new

    def _connect_new(self, new: dict) -> None:
        """Connect workers not yet in the pool to the receivers as they are now."""
        table = dict(self._receivers)
        if table:
            ray.get([w.connect_receivers.remote(table) for w in new.values()],
                    timeout=max(120.0, self.timeout_s))

    def heal(self, timeout_s: float = 10.0) -> list[int]:
        """Replace the workers that died since a chunk last ran on them; returns their instances.

        A chunk finds a dead member itself, but a worker may die with no chunk to run: its
        instance would then keep a dead actor until the next plan lands on it, and the KV it
        was still streaming would be waited for until the receivers' stall timeout. Probing
        every worker (``alive`` answers beside a running chunk) and replacing the dead ones
        tells the receivers too (``_restore_transfer``), and they give up the dead worker's
        shards at once. A worker that does not answer within ``timeout_s`` but is not known dead
        is left alone."""
        dead = _dead_among(list(self.workers), timeout_s)
        if dead:
            self._reform(dead)
        return sorted(dead)

    def _task(self, plan, k, r, lay, token_ids, seq, opts: "_RunOptions", world: int) -> ChunkTask:
        c = plan.chunks[k]
        balance = opts.balance
        mine = lay.chunk_positions[r]
        return ChunkTask(
            request_id=plan.request_id, chunk_index=k, num_chunks=len(plan.chunks), seq=seq,
            group=lay.group, rank=r, chunk_start=c.start, chunk_end=c.end,
            prompt_tokens=plan.prompt_tokens, chunk_positions=lay.chunk_positions,
            history=lay.history, moves=lay.moves if balance != "off" else (),
            token_ids=self._member_tokens(token_ids, mine), balance=balance,
            sampling=opts.sampling, return_logits=opts.return_logits, timeout_s=self.timeout_s,
            kv_receivers=opts.kv_receivers, world=world,
        )

    def _member_tokens(self, token_ids: TokenIds, mine) -> TokenIds:
        """A member's share of the prompt: its chunk slice as int32, none for an emulated
        executor (it computes nothing from token values)."""
        return TokenIds("i") if self.emulated else token_slices(token_ids, mine)

    def _phase(self, plan: PrefillPlan, k: int, tasks: list[ChunkTask], handles: list,
               method: str):
        """Run ``method`` on every member (``handles``, in task order); on failure name the
        root-cause worker."""
        refs = [getattr(h, method).remote(t) for h, t in zip(handles, tasks)]
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=self.chunk_timeout_s)
        out, errors = [], []
        for t, ref in zip(tasks, refs):
            if ref in pending:
                errors.append((t, TimeoutError(f"no answer in {self.chunk_timeout_s}s")))
                continue
            try:
                out.append(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - every failure becomes a PrefillError
                errors.append((t, getattr(e, "cause", None) or e))
        if errors:
            # Peers of a failed worker time out or lose their gloo connection to it: report the
            # root cause first.
            errors.sort(key=lambda te: _is_secondary(te[1]))
            t, err = errors[0]
            others = ", ".join(str(e[0].instance) for e in errors[1:])
            # a dead member is replaced (``_recover``) before the caller sees the error
            lost = any(isinstance(e, ray.exceptions.RayActorError) for _t, e in errors)
            raise _ChunkFailed(method, len(tasks), [(e[0].instance, e[1]) for e in errors],
                               {t.instance: handle for t, handle in zip(tasks, handles)},
                               (PrefillWorkerLost if lost else PrefillError)(
                f"request {plan.request_id} chunk {k} failed on prefill instance {t.instance} "
                f"(node {self.node_of[t.instance]}) during {method}: {type(err).__name__}: "
                f"{_first_line(err)}" + (f"; also failed: instances {others}" if others else "")
            ))
        return out

    def _result(self, plan, results, final, elapsed, waits) -> PrefillResult:
        last = [r for r in results[-1] if r.first_token is not None or r.emulated]
        first = last[0] if last else None
        return PrefillResult(
            request_id=plan.request_id,
            first_token=first.first_token if first else None,
            logits=first.logits if first else None,
            first_logprob=first.first_logprob if first else None,
            elapsed_s=elapsed,
            chunk_elapsed_s=tuple(max(r.elapsed_s for r in rs) for rs in results),
            balance_wait_s=sum(max(r.balance_wait_s for r in rs) for rs in results),
            balance_moved_tokens=sum(r.balance_sent_tokens for rs in results for r in rs),
            kv_layout=tuple(sorted(final.items())),
            emulated=self.emulated,
            queued_s=waits[0],
            turn_wait_s=sum(waits[1:]),
        )

    def _abort_quietly(self, request_id: str, instances: list[int]) -> None:
        try:
            self._abort_workers(request_id, instances)
        except Exception as e:  # noqa: BLE001 - the original error matters more
            log.warning("abort of %s on %s failed: %s", request_id, instances, e)

    def _abort_workers(self, request_id: str, instances) -> None:
        self._on_workers([self.workers[i] for i in instances], lambda w: w.abort.remote(request_id))

    # -- KV ownership -------------------------------------------------------------------------
    def abort(self, request_id: str, instances: list[int] | None = None) -> None:
        """Cancel the request: its chunks no longer hold later plans back, its ``run`` (pending
        or under way) raises ``PrefillError``, and its KV and unfinished KV shards are freed on
        ``instances`` (default: every worker). A chunk already executing finishes first."""
        self._tickets.cancel(request_id)
        self._abort_workers(request_id, range(self.size) if instances is None else instances)

    def release(self, request_id: str) -> None:
        """The request's KV has been handed off: free it everywhere."""
        self._on_workers(self.workers, lambda w: w.release.remote(request_id))

    def _on_workers(self, workers, call, timeout_s: float | None = None) -> list:
        """``call(worker)`` (an ObjectRef) on each worker actor, answers in order. A dead
        worker answers None: it holds nothing any more, and it is replaced when a chunk or
        ``connect_receivers`` finds it, so freeing a request must not fail on it."""
        refs = [call(w) for w in list(workers)]
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=timeout_s or self.chunk_timeout_s))
            except ray.exceptions.RayActorError:
                out.append(None)
        return out

    def export_kv(self, request_id: str) -> dict[int, tuple]:
        """instance -> (positions, k [L, n, Hkv, D], v) for every worker holding some of it."""
        parts = ray.get([w.export_kv.remote(request_id) for w in self.workers])
        return {i: p for i, p in enumerate(parts) if p[0].numel()}

    def held_requests(self) -> dict[int, list[str]]:
        """instance -> requests with KV or transfer shards still held there."""
        held = self._on_workers(self.workers, lambda w: w.held_requests.remote())
        return {i: h or [] for i, h in enumerate(held)}

    def node_map(self) -> list[int]:
        """Each worker's node index: the real Ray nodes on a multi-node cluster, virtual nodes
        of ``node_size`` on one node (``placement.node_map``)."""
        return list(self.node_of)

    # -- KV streaming -------------------------------------------------------------------------
    def enable_transfer(self, config: TransferConfig) -> dict[int, AgentInfo]:
        """Start every worker's send side; instance -> its agent's info."""
        infos = ray.get([w.enable_transfer.remote(config) for w in self.workers],
                        timeout=max(120.0, self.timeout_s))
        self._transfer = config
        return dict(enumerate(infos))

    def connect_receivers(self, peers: dict[int, tuple]) -> None:
        """receiver id -> (actor handle with ``deliver_transfer``, its AgentInfo), on every worker.

        The table is kept first, so a worker replaced at any later point connects to these
        receivers, not to ones they replaced. A worker found dead here is replaced now (it
        would otherwise keep the old receivers until a chunk found it). Last, the receivers
        are told the workers as they are then: a restarted receiver may have been given a
        table of senders read before a replacement went in."""
        if self._transfer is None:
            raise RuntimeError("connect_receivers needs enable_transfer first")
        self._receivers.update(peers)
        workers = list(self.workers)
        skipped = self._on_workers(workers, lambda w: w.connect_receivers.remote(dict(peers)),
                                   timeout_s=max(120.0, self.timeout_s))
        dead = {i: w for i, (w, s) in enumerate(zip(workers, skipped)) if s is None}
        if dead:
            self._reform(dead)
        # The receivers learn the workers as they are now: a receiver restarted with a table
        # of senders read before a replacement went in would send its grants to a dead actor.
        self._tell_receivers(peers, dict(enumerate(self.workers)))

    def transfer_state(self, request_id: str) -> dict[int, dict]:
        """instance -> that worker's ``transfer_state`` for the request (workers with shards)."""
        states = ray.get([w.transfer_state.remote(request_id) for w in self.workers])
        return {i: st for i, st in enumerate(states) if st["shards"] or st["sent"] or st["failed"]}

    def _restore_transfer(self, new: dict) -> None:
        """The replaced workers' new actors (``new``: instance -> actor) are connected to the
        receivers as they are now (some may have restarted since the workers started) and
        every receiver is told them, so that its grants reach them and not the dead ones, and
        it gives up what the dead ones owed it."""
        if self._transfer is None or not new:
            return
        if self._receivers:
            self._connect_new(new)
            self._tell_receivers(self._receivers, new)

    def _tell_receivers(self, receivers: dict, senders: dict) -> None:
        """Each receiver (id -> (actor, info)) learns ``senders`` (instance -> worker actor, or
        None: the worker is dead and not yet replaced).
        A receiver that is gone is being restarted by its owner, who connects the workers to
        its successor (``connect_receivers``, which tells it the workers as they are then)."""
        for rid, ref in [(rid, h.connect_senders.remote(senders))
                         for rid, (h, _info) in sorted(receivers.items())]:
            try:
                ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                log.warning("receiver %d did not take the senders: %s", rid, e)

    def shutdown(self) -> None:
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


class _RunOptions(NamedTuple):
    balance: BalanceMode
    sampling: SamplingParams | None
    return_logits: bool
    kv_receivers: tuple[int, ...]
    on_chunk_start: Callable[[int], None] | None
    on_chunk_end: Callable[[int, bool], None] | None


class _ChunkFailed(Exception):
    def __init__(self, method: str, group_size: int, errors: list, handles: dict,
                 error: PrefillError):
        super().__init__(str(error))
        self.method, self.group_size, self.errors, self.error = method, group_size, errors, error
        self.handles = handles   # instance -> the worker actor the chunk was sent to


def _dead_among(workers: list, timeout_s: float) -> dict:
    """instance -> handle of the workers known dead after probing them all (``alive``) for at
    most ``timeout_s``; one that does not answer in time is not counted dead."""
    refs = [w.alive.remote() for w in workers]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    dead = {}
    for i, (w, ref) in enumerate(zip(workers, refs)):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead[i] = w
        except ray.exceptions.GetTimeoutError:
            pass
    return dead


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else ""


_SECONDARY = ("imed out", "Connection closed by peer", "Connection reset by peer")


def _is_secondary(err: BaseException) -> bool:
    """An error a ring peer sees because another member failed, not a root cause."""
    return isinstance(err, TimeoutError) or any(m in str(err) for m in _SECONDARY)
