"""The driver side of the SP pool: plans executed chunk by chunk on the pool's workers.

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
   chunks it runs (``worlds.py``, ``world.py``), so the pool never stops. Meanwhile ``commit``
   refuses a new plan on the instance (``InstanceReplacing``: the planner plans again around
   it), and a chunk there whose plan was committed before the worker was found dead is lost
   at once (``PrefillPlanOutdated``); only a plan its planner insisted on
   (``wait_replacing``) waits for the replacement.
The KV stays on the workers until ``release`` (after hand-off) or ``abort``.

``run`` is thread-safe. Chunks start on each instance in commit order (``commit``, tickets of
``chunk_order``), so concurrent plans on overlapping groups cannot deadlock. With
``enable_transfer``/``connect_receivers`` and ``run(..., kv_receivers=...)`` every member
streams the KV it computes to the decode ranks, layer by layer, while the chunk runs.

The workers, the generations of their world and their replacement are the world keeper's
(``worlds.WorldKeeper``), the transfer wiring (send side, receivers' table) is
``wiring.TransferWiring``'s, and which workers may hold something of a request is
``holders.PlanMembers``'. This module, the chunk driver, asks the keeper for the current
world and its workers (``in_world``), which instances are being replaced, and to replace dead
workers (``reform``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import ray

from tetris.actors.placement import PLACEMENT_TIMEOUT_S, Placement
from tetris.actors.prefill.chunk_order import ChunkTickets
from tetris.actors.prefill.chunks import (ChunkFailed, RunOptions, chunk_task, prefill_result,
                                          run_phase)
from tetris.actors.prefill.holders import PlanMembers, on_workers
from tetris.actors.prefill.layout import plan_layout
from tetris.actors.prefill.messages import (BalanceMode, ChunkResult, PrefillPlanOutdated,
                                            PrefillResult)
from tetris.actors.prefill.prefix import adopt_prefix
from tetris.actors.prefill.prefix_move import move_prefix
from tetris.actors.prefill.tp_groups import check_streaming
from tetris.actors.prefill.wiring import TransferWiring
from tetris.actors.prefill.worlds import WorldKeeper
from tetris.config import DeploymentConfig, TransferConfig
from tetris.errors import InstanceReplacing
from tetris.plan import PlanError, PrefillPlan
from tetris.sampling_params import SamplingParams
from tetris.token_ids import TokenIds, compact_tokens
from tetris.transfer.messages import AgentInfo

__all__ = ["PrefillPool"]

log = logging.getLogger(__name__)


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
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._tickets = ChunkTickets(n)
        self._members = PlanMembers(n)   # the workers that may hold something of a request
        self._wiring = TransferWiring(timeout_s)
        # the workers, their world's generations and their replacement
        self.worlds = WorldKeeper(
            deployment, n, per_node, profile=profile or deployment.scheduler.profile,
            timeout_s=timeout_s, placement=placement, placement_timeout_s=placement_timeout_s,
            wiring=self._wiring, commits=self._tickets.commits)

    # -- the keeper's, as the pool's callers know them ----------------------------------------
    @property
    def workers(self) -> list:
        """The worker actors new chunks start on, by instance."""
        return self.worlds.workers

    @property
    def replacements(self) -> int:
        """Dead workers replaced so far."""
        return self.worlds.replacements

    @property
    def node_of(self) -> tuple[int, ...]:
        return self.worlds.node_of

    @property
    def node_ids(self) -> tuple[str, ...]:
        return self.worlds.node_ids

    @property
    def placement(self) -> Placement:
        return self.worlds.placement

    @property
    def size(self) -> int:
        return self.worlds.size

    # -- running plans ------------------------------------------------------------------------
    def commit(self, plan: PrefillPlan, *, wait_replacing: bool = False) -> list[float]:
        """Fix the plan's place in every member instance's chunk order (call in planning order);
        returns ``busy_for()`` with it committed.

        A plan on an instance whose worker is being replaced is refused (``InstanceReplacing``,
        nothing committed) unless ``wait_replacing``: its planner had not heard yet (the pool
        tells it with each commit), and the plan would hold its other members' turns, and so
        every plan behind it there, until the replacement is in (tens of seconds for a real
        model). The planner plans again with a fresh ``busy_for``."""
        plan.validate(self.size)
        with self.worlds.replacing_held() as held:   # atomic with ``reform`` marking workers dead
            replacing = sorted({i for c in plan.chunks for i in c.instances} & held)
            if replacing and not wait_replacing:
                raise InstanceReplacing(
                    f"plan {plan.request_id} uses prefill instances {replacing}, whose workers "
                    "are being replaced; plan it again around them", tuple(replacing))
            self._tickets.commit(plan)
        self._members.note(plan.request_id, plan.instances)
        return self.busy_for()

    def busy_for(self) -> list[float]:
        """Per instance, the seconds of committed work it still has to run (``ChunkTickets.
        busy_for``: the tickets replayed from the chunks running now), infinite while its
        worker is being replaced: what the dispatcher plans on when the pool runs late."""
        busy = self._tickets.busy_for()
        for i in self.worlds.replacing():
            busy[i] = float("inf")
        return busy

    def run(self, plan: PrefillPlan, token_ids: Sequence[int], *,
            sampling: SamplingParams | None = None, return_logits: bool = False,
            balance: BalanceMode | None = None, kv_receivers: tuple[int, ...] = (),
            on_chunk_start: Callable[[int], None] | None = None,
            on_chunk_end: Callable[[int, bool], None] | None = None,
            prefix_streamed: bool = True, kv_ranges: tuple = ()) -> PrefillResult:
        """Execute a plan; returns the first token. Raises PlanError / PrefillError.

        Commits the plan unless ``commit`` did. Each chunk waits for its turn on its members;
        ``on_chunk_start(k)`` runs right before chunk ``k``'s prepare, ``on_chunk_end(k, ok)``
        after its execute (or its failure), both in this thread. ``prefix_streamed=False``: the
        decode instance has the cached prefix already (prefix caching's decode side), only the
        chunks stream. ``kv_ranges``: elastic decode's targets per token range instead of
        ``kv_receivers`` (actors/prefill/range_stream.py).
        """
        plan.validate(self.size)
        token_ids = compact_tokens(token_ids)   # no copy for the dispatcher's int32 array
        self._tickets.start(plan)
        self._members.note(plan.request_id, plan.instances)
        try:
            if len(token_ids) != plan.prompt_tokens:
                raise PlanError(f"plan {plan.request_id} is for {plan.prompt_tokens} tokens, "
                                f"the prompt has {len(token_ids)}")
            opts = RunOptions(balance or self.balance, sampling, return_logits,
                              tuple(kv_receivers), on_chunk_start, on_chunk_end,
                              prefix_streamed, tuple(kv_ranges), csa=self.deployment.csa)
            return self._run_chunks(plan, token_ids, opts)
        finally:
            self._tickets.finish(plan.request_id)

    def _run_chunks(self, plan: PrefillPlan, token_ids: TokenIds,
                    opts: RunOptions) -> PrefillResult:
        waits: list[float] = []   # per chunk, the wait for its turn on its members
        touched: list[int] = sorted(plan.cached_instances)
        results: list[list[ChunkResult]] = []
        try:
            cached = None
            if plan.cached_tokens:
                # The prefix's run may still be running on its holders (it is readable from
                # its commit): its chunks there come first, so the copy waits for our turn.
                self._turn(plan, 0, waits)
                if plan.cached_moved:   # to chunk 0's group G, which frees it on failure
                    touched = sorted(set(touched) | set(plan.chunks[0].instances))
                    cached = move_prefix(self, plan, opts)
                else:
                    cached = adopt_prefix(self, plan, opts)
            layouts, final = plan_layout(plan, opts.balance, cached)
            for k, lay in enumerate(layouts):
                if k or cached is None:
                    self._turn(plan, k, waits)
                if k == 0:
                    t0 = time.perf_counter()
                touched = sorted(set(touched) | set(lay.group))
                results.append(self._run_chunk(plan, k, lay, token_ids, opts))
        except ChunkFailed as failed:
            # The failed chunk's tickets stay until the world is whole again (run's finally).
            self._recover(plan.request_id, touched, failed)
            raise failed.error from None
        except BaseException:
            self._abort_quietly(plan.request_id, touched)
            raise
        return prefill_result(plan, results, final, time.perf_counter() - t0, waits,
                              emulated=self.emulated)

    def _turn(self, plan: PrefillPlan, k: int, waits: list[float]) -> None:
        """Wait for chunk ``k``'s turn on its members; the wait is appended to ``waits``."""
        w0 = time.perf_counter()
        self._await_replacements(plan, k, wait=False)
        self._tickets.wait_turn(plan.request_id, k, self.chunk_timeout_s)
        waits.append(time.perf_counter() - w0)

    def _run_chunk(self, plan, k, lay, token_ids, opts: RunOptions) -> list[ChunkResult]:
        with self._lock:
            seq = next(self._seq)
        if opts.on_chunk_start is not None:
            opts.on_chunk_start(k)
        phase = {"timeout_s": self.chunk_timeout_s, "node_of": self.node_of}
        try:
            self._await_replacements(plan, k)
            with self.worlds.in_world() as (world, workers):
                tasks = [chunk_task(plan, k, r, lay, token_ids, seq, opts, world,
                                    timeout_s=self.timeout_s, emulated=self.emulated,
                                    node_of=self.node_of)
                         for r in range(len(lay.group))]
                handles = [workers[t.instance] for t in tasks]
                run_phase(plan, k, tasks, handles, "prepare", **phase)
                out = run_phase(plan, k, tasks, handles, "execute", **phase)
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

    def _recover(self, request_id: str, touched: list[int], failed: ChunkFailed) -> None:
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
            self.worlds.reform(dead, wait=False)
        elif failed.method == "execute" and failed.group_size > 1:
            self.worlds.new_world([])

    def _await_replacements(self, plan: PrefillPlan, k: int, *, wait: bool = True) -> None:
        """Before chunk ``k`` waits for its turn, and again before it starts: if an instance of
        this or a later chunk is being replaced and the plan was committed before that worker
        was found dead, the run fails at once with ``PrefillPlanOutdated`` (it could not plan
        around it; going on would spend its earlier chunks' GPU time on a run that is lost
        anyway, and waiting would hold every member's turn, and so every plan behind it, for as
        long as a replacement takes). A chunk whose
        plan was committed since (``commit(..., wait_replacing=True)``, or run without a
        commit) waits for its own members' replacements (``wait``)."""
        number = self._tickets.number(plan.request_id) or 0
        later = {i for c in plan.chunks[k:] for i in c.instances}
        while True:
            blind, pending = self.worlds.replacements_for(number, later, plan.chunks[k].instances)
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

    def heal(self, timeout_s: float = 10.0) -> list[int]:
        """Replace the workers that died since a chunk last ran on them; returns their
        instances (``WorldKeeper.heal``)."""
        return self.worlds.heal(timeout_s)

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
        ``instances`` (default: its plan's members). A chunk already executing finishes first."""
        self._tickets.cancel(request_id)
        holders = self._members.holders(request_id)
        self._abort_workers(request_id, holders if instances is None else instances)

    def release(self, request_id: str) -> None:
        """The request's KV has been handed off: free it on its plan's members."""
        workers = list(self.workers)
        self._on_workers([workers[i] for i in self._members.holders(request_id)],
                         lambda w: w.release.remote(request_id))

    def _on_workers(self, workers, call, timeout_s: float | None = None) -> list:
        """``holders.on_workers``, by default with the chunk timeout."""
        return on_workers(workers, call, timeout_s or self.chunk_timeout_s)

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
        check_streaming(self.deployment)   # TP instances stream whole head slices (tp.py)
        return self._wiring.enable(self.workers, config)

    def connect_receivers(self, peers: dict[int, tuple]) -> None:
        """receiver id -> (actor handle with ``deliver_transfer``, its AgentInfo), on every worker.

        The table is kept first, so a worker replaced at any later point connects to these
        receivers, not to ones they replaced. A worker found dead here is replaced now (it
        would otherwise keep the old receivers until a chunk found it). Last, the receivers
        are told the workers as they are then: a restarted receiver may have been given a
        table of senders read before a replacement went in."""
        if self._wiring.config is None:
            raise RuntimeError("connect_receivers needs enable_transfer first")
        self._wiring.receivers.update(peers)
        workers = list(self.workers)
        skipped = self._on_workers(workers, lambda w: w.connect_receivers.remote(dict(peers)),
                                   timeout_s=max(120.0, self.timeout_s))
        dead = {i: w for i, (w, s) in enumerate(zip(workers, skipped)) if s is None}
        if dead:
            self.worlds.reform(dead)
        # The receivers learn the workers as they are now: a receiver restarted with a table
        # of senders read before a replacement went in would send its grants to a dead actor.
        self._wiring.tell_receivers(peers, dict(enumerate(self.workers)))

    def transfer_state(self, request_id: str) -> dict[int, dict]:
        """instance -> that worker's ``transfer_state`` for the request (workers with shards)."""
        states = ray.get([w.transfer_state.remote(request_id) for w in self.workers])
        return {i: st for i, st in enumerate(states) if st["shards"] or st["sent"] or st["failed"]}

    def shutdown(self) -> None:
        self.worlds.shutdown()
