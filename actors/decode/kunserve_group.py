"""KunServe over the served decode pool: the controller's decisions applied to decode instances.

``ServedKunServe`` holds the ``KunServeController`` that the simulator and the EMULATION use,
with one unit per undropped instance or group (keyed by its first member), and applies what
it decides to the pool's ``DecodeInstance``s (TP 1), whose rank actors become the group's
pipeline stages (``pipeline_stage.GroupMember`` through ``rank_kunserve.KunServeRank``).

Lifecycle of a drop of group ``members`` keeping ``layer_ranges``, with the members' rounds
paused (each instance's ``round_lock``; commands queue meanwhile):

1. every member listens (``kunserve_join``) and says how many blocks of its layers it could
   hold and how many its requests use; the group's blocks are the least member's (KunServe
   invariant 2), split into one part per member in proportion to its undropped blocks; a
   member whose requests do not fit its part refuses the drop before anything changed;
2. the members connect their pair links and drop at once (KV exchanged, nothing recomputed);
3. each instance's ``kv_blocks`` becomes its part: the pool's reported capacity grows by the
   freed parameter bytes over the block bytes.

A restore pauses the members again, checks that every member's requests fit its undropped
cache, then pulls layers and KV back and closes the links.

A member that dies (its rank actor is gone: its own and its peers' steps fail on the broken
links) takes the KV of its layers for every request of the group with it, so every request
of the group fails with ``DecodeInstanceLost`` and takes the dispatcher's resume path
(recomputed from its prompt and the tokens its client has); requests on instances outside
the group go on untouched. ``rebuild_after_loss`` lets the group go: each member whose rank
still answers is rebuilt in place (same actor: the layers from the model's checkpoint, a
whole-model cache, ``rank_kunserve.kunserve_rebuild``) and serves again at once; the dead one
stays broken and the supervisor restarts it. A later overload drops again with the new
member (the controller's ordinary next decision).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

from tetris.control.drop_plan import DropRefused, Group
from tetris.control.kunserve import Decision, KunServeController
from tetris.control.kunserve_memory import InstanceLoad, InstanceMemory

__all__ = ["ServedKunServe", "split_parts"]

log = logging.getLogger(__name__)

_REBUILD_S = 600.0   # a survivor's checkpoint load; past it, the supervisor restarts it instead


def split_parts(group_blocks: int, base: list[int], used: list[int]) -> list[tuple[int, int]]:
    """The group's block ids ``[0, group_blocks)`` as one part per member, in proportion to
    its undropped blocks ``base`` (the last takes the remainder); ``ValueError`` if a
    member's requests (``used`` blocks) do not fit its part."""
    total = sum(base)
    bounds = [0]
    for b in base[:-1]:
        bounds.append(bounds[-1] + group_blocks * b // total)
    bounds.append(group_blocks)
    parts = list(itertools.pairwise(bounds))
    for j, ((lo, hi), u) in enumerate(zip(parts, used, strict=True)):
        if u > hi - lo:
            raise ValueError(f"member {j}'s requests hold {u} blocks, its part of the group "
                             f"{hi - lo}")
    return parts


@contextlib.asynccontextmanager
async def _paused(instances):
    """No round runs on ``instances`` inside (locks taken in instance order)."""
    async with contextlib.AsyncExitStack() as stack:
        for inst in sorted(instances, key=lambda i: i.instance):
            await stack.enter_async_context(inst.round_lock)
        yield


class ServedKunServe:
    def __init__(self, instances, *, timeout_s: float = 60.0, landing_blocks: int = 0,
                 lookahead_overhead_seqs: float | None = None) -> None:
        self.instances = list(instances)
        # whole-model blocks a dropped member keeps to land prefilled prompts in (landing.py)
        self.landing_blocks = landing_blocks
        # members form lookahead micro-batches (§4.3) with this load per micro-batch; None: off
        self.lookahead_overhead_seqs = lookahead_overhead_seqs
        self.timeout_s = timeout_s
        self.controller: KunServeController | None = None
        self.refused: list[str] = []
        self.freed_param_bytes: dict[int, int] = {}
        self.exchange_bytes = 0    # KV bytes sent between members by drops and restores
        self.rebuilt: list[int] = []   # instances rebuilt in place after losing a member
        self.lost_requests = 0     # requests dropped on survivors (resumed by the dispatcher)
        self.lock = asyncio.Lock()   # one decision applied at a time (monitor, admin)

    async def start(self) -> None:
        """The memory model from instance 0's rank tensors (every instance holds the same)."""
        if any(inst.tp_size != 1 for inst in self.instances):
            raise ValueError("KunServe groups of served decode instances need TP 1")
        fields = await self.instances[0].ranks[0].kunserve_memory.remote()
        # a request takes blocks of its member's part only, and lands in its landing zone
        mem = InstanceMemory(**fields, member_parts=True, landing_blocks=self.landing_blocks)
        self.controller = KunServeController(mem, list(range(len(self.instances))))

    # -- the monitor ----------------------------------------------------------------------
    def loads(self, queued_blocks: dict[int, int] | None = None) -> dict[int, InstanceLoad]:
        """Each unit's KV report from its members' last round stats; ``queued_blocks``: what
        requests waiting for an instance need (the dispatcher's refused reservations)."""
        queued = queued_blocks or {}
        out = {}
        for g in self.controller.groups:
            stats = [self.instances[m].stats() for m in g.members]
            total = sum(inst.kv_blocks for inst in (self.instances[m] for m in g.members))
            used = sum(s.total_blocks - s.free_blocks for s in stats if s is not None)
            out[g.members[0]] = InstanceLoad(total, used, 0,
                                             sum(queued.get(m, 0) for m in g.members))
        return out

    async def tick(self, queued_blocks: dict[int, int] | None = None,
                   fit_blocks: int = 0) -> str | None:
        """One monitor period: "drop", "restore" or None (nothing to do, or refused);
        ``fit_blocks``: a refused reservation's blocks, which some unit must be able to take."""
        async with self.lock:
            return await self._tick(queued_blocks, fit_blocks)

    async def _tick(self, queued_blocks: dict[int, int] | None,
                    fit_blocks: int = 0) -> str | None:
        if not all(inst.serving for inst in self.instances):
            # a broken or restarting instance cannot join a group (and a group with a broken
            # member is rebuilt first): no decision until the supervisor brought it back
            return None
        before = list(self.controller.groups)
        decision = self.controller.decide(self.loads(queued_blocks), fit_blocks)
        if decision is None:
            return None
        try:
            await self._apply(before, decision)
        except BaseException as e:   # the grouping and the counts stay what the instances run
            self._roll_back(before, "drops" if decision.kind == "drop" else "restores")
            if not isinstance(e, ValueError):
                raise
            self.refused.append(str(e))
            log.warning("KunServe %s not applied: %s", decision.kind, e)
            return None
        return decision.kind

    # -- an operator's actions (admin routes) ---------------------------------------------
    async def force_drop(self, groups: list[Group]) -> Decision:
        """``DropRefused`` (nothing changed) for a plan losing a layer's last copy, naming an
        unknown or grouped instance, or one the members cannot hold."""
        async with self.lock:
            return await self._force(lambda: self.controller.force_drop(groups), "drops")

    async def _force(self, decide: Callable[[], Decision], counter: str) -> Decision:
        """Apply the controller's forced decision; if applying fails, the groups and the
        controller's ``counter`` (``drops`` or ``restores``) are as they were before."""
        before = list(self.controller.groups)
        decision = decide()
        try:
            await self._apply(before, decision)
        except BaseException as e:
            self._roll_back(before, counter)
            if isinstance(e, ValueError):
                raise DropRefused(str(e)) from e
            raise
        return decision

    def _roll_back(self, before: list[Group], counter: str) -> None:
        """A decision not applied: the controller's groups as before, its ``counter``
        (``drops`` or ``restores``) one less."""
        self.controller.groups = before
        setattr(self.controller, counter, getattr(self.controller, counter) - 1)

    async def force_restore(self, leader: int) -> Decision:
        """``DropRefused`` (nothing changed) for no such group or requests that would not fit."""
        async with self.lock:
            return await self._force(lambda: self.controller.force_restore(leader),
                                     "restores")

    def unit_blocks(self) -> dict[int, int]:
        """KV blocks each serving unit (an instance, or a group by its first member) has."""
        return {g.members[0]: sum(self.instances[m].kv_blocks for m in g.members)
                for g in self.controller.groups}

    def dropped_layers(self) -> dict[int, int]:
        """``tetris:dropped_layers{instance}``."""
        return self.controller.dropped_layers()

    def state(self) -> dict:
        return {"groups": [{"members": list(g.members),
                            "layer_ranges": [list(r) for r in g.layer_ranges]}
                           for g in self.controller.groups],
                "dropped_layers": {str(k): v for k, v in self.dropped_layers().items()},
                "kv_blocks": [inst.kv_blocks for inst in self.instances],
                "drops": self.controller.drops, "restores": self.controller.restores,
                "refused": list(self.refused[-8:]),
                "rebuilt_in_place": list(self.rebuilt), "lost_requests": self.lost_requests,
                "restarts": [inst.restarts for inst in self.instances]}

    # -- applying decisions ---------------------------------------------------------------
    async def _apply(self, before: list[Group], decision: Decision) -> None:
        if decision.kind == "drop":
            for g in decision.drop.groups:
                if g not in before and g.size > 1:
                    if any(b.size > 1 and set(b.members) & set(g.members) for b in before):
                        raise ValueError("served groups merge undropped instances only; "
                                         "restore first")
                    await self._drop(g)
        else:
            await self._restore(decision.restored_group)

    async def _drop(self, group: Group) -> None:
        insts = [self.instances[m] for m in group.members]
        ranks = [inst.ranks[0] for inst in insts]
        async with _paused(insts):
            joined = await asyncio.gather(*[r.kunserve_join.remote(j, self.lookahead_overhead_seqs)
                                            for j, r in enumerate(ranks)], return_exceptions=True)
            try:
                for got in joined:
                    if isinstance(got, BaseException):
                        raise got
                checks = await asyncio.gather(*[
                    r.kunserve_check_drop.remote(s, e, self.landing_blocks)
                    for r, (s, e) in zip(ranks, group.layer_ranges, strict=True)])
                group_blocks = min(c[0] for c in checks)
                parts = split_parts(group_blocks, [inst.kv_blocks for inst in insts],
                                    [c[1] for c in checks])
                await asyncio.wait_for(asyncio.gather(*[
                    r.kunserve_connect.remote(list(joined), self.timeout_s) for r in ranks]),
                    self.timeout_s)
            except BaseException:
                await asyncio.gather(*[r.kunserve_leave.remote() for r in ranks],
                                     return_exceptions=True)
                raise
            ranges = [list(r) for r in group.layer_ranges]
            done = await asyncio.gather(*[
                r.kunserve_drop.remote(ranges, group_blocks, parts, self.landing_blocks)
                for r in ranks])
            states = await asyncio.gather(*[r.stats.remote() for r in ranks])
            for inst, (lo, hi), d, s in zip(insts, parts, done, states, strict=True):
                inst.kv_blocks = hi - lo
                inst.note_stats(s)   # the router's free blocks: the member's part now
                self.freed_param_bytes[inst.instance] = int(d["freed_param_bytes"])
                self.exchange_bytes += int(d["exchange_bytes"])
        log.info("KunServe drop: instances %s keep layers %s, %d group blocks",
                 list(group.members), ranges, group_blocks)

    async def _restore(self, group: Group) -> None:
        insts = [self.instances[m] for m in group.members]
        ranks = [inst.ranks[0] for inst in insts]
        async with _paused(insts):
            await asyncio.gather(*[r.kunserve_check_restore.remote() for r in ranks])
            await asyncio.gather(*[r.kunserve_restore.remote() for r in ranks])
            sent = await asyncio.gather(*[r.kunserve_leave.remote() for r in ranks])
            self.exchange_bytes += sum(int(b) for b in sent)
            states = await asyncio.gather(*[r.stats.remote() for r in ranks])
            for inst, s in zip(insts, states, strict=True):
                inst.kv_blocks = s.total_blocks
                inst.note_stats(s)   # else the router keeps the group part's free blocks
                self.freed_param_bytes.pop(inst.instance, None)
        log.info("KunServe restore: instances %s are replicas again", list(group.members))

    async def rebuild_after_loss(self, ping_timeout_s: float = 30.0) -> list[int]:
        """Every group with a broken member is let go: members whose rank still answers are
        rebuilt in place and serve again; the others stay broken for the supervisor to
        restart. Returns the instances rebuilt in place."""
        async with self.lock:
            rebuilt = []
            for g in [g for g in self.controller.groups if g.size > 1 and any(
                    self.instances[m].broken is not None for m in g.members)]:
                self._let_go(g)
                insts = [self.instances[m] for m in g.members]
                alive = await asyncio.gather(*[_answers(inst, ping_timeout_s) for inst in insts])
                for inst, ok in zip(insts, alive, strict=True):
                    # every request of the group lost its KV of the dead member's layers
                    inst._break(RuntimeError(f"KunServe group {list(g.members)} lost a member"))
                    if ok and await self._rebuild(inst):
                        rebuilt.append(inst.instance)
            self.rebuilt += rebuilt
            return rebuilt

    def _let_go(self, g: Group) -> None:
        """The controller's grouping without ``g``: its members are single instances again."""
        self.controller.groups = sorted(
            [x for x in self.controller.groups if x is not g]
            + [Group((m,), ((0, self.controller.mem.num_layers),)) for m in g.members],
            key=lambda x: x.members[0])
        for m in g.members:
            self.freed_param_bytes.pop(m, None)

    async def _rebuild(self, inst) -> bool:
        """One survivor back to a whole replica in its own actor; False (left broken, so the
        supervisor restarts it) if that failed."""
        try:
            async with inst.round_lock:   # a real checkpoint takes minutes to load
                done = await asyncio.wait_for(inst.ranks[0].kunserve_rebuild.remote(),
                                              max(self.timeout_s, _REBUILD_S))
            await inst.resume_rounds()
        except Exception:
            log.exception("KunServe: rebuilding instance %d in place failed; it restarts",
                          inst.instance)
            return False
        self.lost_requests += len(done["lost_requests"])
        log.warning("KunServe: instance %d rebuilt in place after its group lost a member "
                    "(held %d layers; %d requests resumed by the dispatcher)", inst.instance,
                    done["held_layers"], len(done["lost_requests"]))
        return True


async def _answers(inst, timeout_s: float) -> bool:
    """Whether the instance's rank actor is alive and answers within ``timeout_s``."""
    try:
        await asyncio.wait_for(inst.ranks[0].__ray_ready__.remote(), timeout_s)
    except Exception:  # noqa: BLE001 - dead (RayActorError) or hung: not rebuilt here
        return False
    return True
