"""A decode rank's KunServe calls, mixed into ``DecodeRank`` (issue #24).

The group driver (``actors/decode/kunserve_group.py``) calls these on rank 0 of each member
instance (TP 1) while the instances' rounds are paused: ``kunserve_join`` (listen),
``kunserve_check_drop``, ``kunserve_connect``, ``kunserve_drop``, later
``kunserve_check_restore``, ``kunserve_restore`` and ``kunserve_leave``. The work is
``pipeline_stage.GroupMember``'s. While the rank is dropped, a prefill elsewhere streams
whole-model KV to it while it holds only its layers: with ``[kunserve] landing_blocks`` the
KV lands in a whole-model landing zone and is forwarded to the keepers layer by layer
(``landing.py``); without one a reservation is refused (``DecodeFull``).
"""

from __future__ import annotations

import time

import ray
from tetris.actors.decode.landing import LandingZone
from tetris.actors.decode.messages import Rejected, Reserve
from tetris.actors.decode.pipeline_stage import GroupMember, layer_block_bytes
from tetris.transfer.traffic import TrafficClass

from tetris.engine.pipeline import layer_bytes
from tetris.scheduler.member_lookahead import MemberLookahead, decode_cost_model

__all__ = ["KunServeRank"]


class KunServeRank:
    """Mixed into ``DecodeRank`` before ``RankCommands`` (its ``_reserve`` goes first)."""

    group_member: GroupMember | None = None
    _landing = None             # LandingZone while dropped with one

    def _reserve(self, cmd: Reserve) -> Rejected | None:
        if self.group_member is None or self.group_member.runner is None:
            return super()._reserve(cmd)
        if self._landing is None or cmd.keep or cmd.prefix_tokens or cmd.kv_start:
            return Rejected(cmd.request_id, "this decode instance runs as a KunServe pipeline "
                            "stage without room to land a prefilled prompt's KV", full=True)
        return self._landing.reserve(self, cmd)

    def _request_ready(self, request_id: str) -> None:
        """A request's KV is complete here (pump thread, events lock held): reported to the
        driver now, or, landed while dropped, once every keeper has its layers."""
        if self._landing is not None and self._landing.holds(request_id):
            self._landing.forward(self, request_id)
        else:
            self._ready.append(request_id)

    def _landed(self, request_id: str) -> None:
        """Every keeper wrote the landed request's layers (a link thread)."""
        fenced = self._landing.landed_at(request_id)
        self._landing.release(request_id)
        if fenced is not None:   # aborted meanwhile: its blocks go back at the next step
            with self.pump.locked():
                self._blocks.release_held(fenced)
            return
        with self._events_lock:
            self._ready.append(request_id)

    def _abort(self, request_id: str, reason: str) -> None:
        fence = self._landing.abort(request_id) if self._landing is not None else None
        super()._abort(request_id, reason)
        if self._landing is not None:
            self._landing.release(request_id)
        if fence:   # keepers may still write these group blocks: not reused until they did
            with self.pump.locked():
                self._blocks.withhold(self._engine().blocks, fence)

    def kunserve_memory(self) -> dict:
        """``InstanceMemory``'s fields from this rank's tensors (undropped)."""
        engine = self._engine()
        model = engine.model
        per_layer = layer_bytes(model.layers[0])
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        cache = engine.cache.buffer
        return {"num_layers": model.num_layers, "layer_param_bytes": per_layer,
                "other_param_bytes": total - model.num_layers * per_layer,
                "kv_bytes": cache.numel() * cache.element_size(),
                "layer_block_bytes": layer_block_bytes(engine),
                "block_size": engine.blocks.block_size}

    def kunserve_join(self, member: int, lookahead_overhead_seqs: float | None = None
                      ) -> tuple[str, int]:
        """Listen as member ``member``; with ``lookahead_overhead_seqs`` (``[kunserve]
        lookahead``), form lookahead micro-batches with that load per micro-batch."""
        if self.tp_size != 1 or self.elastic is not None or self.kept is not None:
            raise ValueError("a KunServe member is a TP-1 decode instance without elastic "
                             "decode or kept prefixes")
        if self.pump is not None and self.pump.manager.config.direct_writes:
            raise ValueError("a KunServe member cannot take direct KV writes (registered cache)")
        with self._step_lock:
            if self.group_member is not None:
                raise ValueError(f"decode instance {self.instance} is in a group already")
            self.group_member = GroupMember(self._engine(), member,
                                            ray.util.get_node_ip_address(),
                                            lookahead=_lookahead(self._engine(),
                                                                 lookahead_overhead_seqs))
            return self.group_member.address

    def kunserve_check_drop(self, start: int, end: int, landing_blocks: int = 0
                            ) -> tuple[int, int]:
        """(blocks of layers [start, end) this member could hold beside a landing zone of
        ``landing_blocks`` whole-model blocks, blocks its requests use)."""
        with self._step_lock:
            engine = self._engine()
            s = engine.stats()
            zone = landing_blocks * engine.model.num_layers * layer_block_bytes(engine)
            return self.group_member.check_drop(start, end, zone), s.total_blocks - s.free_blocks

    def kunserve_connect(self, addresses: list, timeout_s: float) -> None:
        self.group_member.connect(addresses, timeout_s)

    def kunserve_drop(self, ranges: list, group_blocks: int, parts: list,
                      landing_blocks: int = 0) -> dict:
        """(freed parameter bytes, KV bytes sent) of this member's drop; with
        ``landing_blocks`` whole-model blocks kept to land prefilled prompts in."""
        with self._step_lock:
            m = self.group_member
            sent = m.exchange_bytes
            freed = m.drop(ranges, group_blocks, parts)
            if landing_blocks and self.pump is not None:
                self._landing = LandingZone(self._engine().model, landing_blocks,
                                            self._engine().blocks.block_size)
                self._retarget_receiver(self._landing.cache)
            else:
                self._retarget_receiver(None)
            return {"freed_param_bytes": freed, "exchange_bytes": m.exchange_bytes - sent}

    def kunserve_check_restore(self) -> None:
        with self._step_lock:
            self.group_member.check_restore(self.group_member.base_blocks)

    def kunserve_restore(self) -> dict:
        """(parameter bytes pulled, KV bytes sent) of this member's restore. The bytes its
        peers pull from it are counted by ``kunserve_leave``."""
        with self._step_lock:
            m = self.group_member
            self._restore_sent = m.exchange_bytes
            pulled = m.restore(m.base_blocks)
            self._landing = None
            self._retarget_receiver(self._engine().cache)
            return {"pulled_param_bytes": pulled}

    def _retarget_receiver(self, cache) -> None:
        """Point the receive manager at ``cache``'s layers (a whole-model cache again), or,
        while dropped, at a one-block placeholder: it takes no reservation then, and the old
        whole-model cache is not kept alive by it."""
        if self.pump is None:
            return
        if cache is None:
            from tetris.engine.kv_cache import KVCache

            cache = KVCache.for_model(self._engine().model, 1, self._engine().blocks.block_size)
        with self.pump.locked() as manager:
            manager.kv_caches = [(cache.k[i], cache.v[i]) for i in range(cache.num_layers)]

    def kunserve_leave(self) -> int:
        """Close the group's links (after every member restored, or to undo a join); the KV
        bytes sent since ``kunserve_restore`` began (its answers to the peers' pulls)."""
        member, self.group_member = self.group_member, None
        if member is None:
            return 0
        member.close()
        return member.exchange_bytes - getattr(self, "_restore_sent", member.exchange_bytes)

    def kunserve_rebuild(self) -> dict:
        """This member's group lost a member: become a whole replica again in this actor.

        The KV of the lost member's layers for every request of the group is gone with it, so
        every request held here is dropped (the driver already failed them with
        ``DecodeInstanceLost``: the dispatcher resumes each from its prompt and the tokens
        its client has). The layers come back from the model's checkpoint (the same load as
        at start: a seeded model, an HF directory or a GGUF file) into a fresh engine with a
        whole-model cache; the actor, its transfer agent, its pump and its senders stay, so
        nothing has to be placed, handshaken or reconnected. Returns the request ids dropped
        and the layers this member held before."""
        with self._step_lock:
            member, self.group_member = self.group_member, None
            if member is not None:
                member.close()
            old = self._engine()
            lost = sorted(old._seqs)
            held = sum(hasattr(layer, "self_attn") for layer in old.model.layers)
            if self.pump is not None:   # landing transfers too: their blocks are the old engine's
                with self.pump.locked() as manager:
                    for rid in sorted(manager.requests):
                        manager.abort(rid, "its KunServe group lost a member", time.monotonic())
            self._landing = None
            # the old engine (its stage cache, the pipeline) goes before the checkpoint loads:
            # on a GPU its memory is what the whole model and cache take again
            self.engine = member = old = None
            self.engine = self._new_engine()
            self._retarget_receiver(self.engine.cache)
            with self._events_lock:   # events of the dropped requests
                self._ready, self._failed, self._first = [], [], []
            return {"lost_requests": lost, "held_layers": held,
                    "total_blocks": self.engine.stats().total_blocks}

    def kunserve_state(self) -> dict:
        """What this member holds and did: layers, blocks, the pipeline's counters."""
        with self._step_lock:
            engine = self._engine()
            m = self.group_member
            held = sum(hasattr(layer, "self_attn") for layer in engine.model.layers)
            out = {"held_layers": held, "dropped_layers": engine.model.num_layers - held,
                   "total_blocks": engine.stats().total_blocks, "in_group": m is not None}
            if m is not None and m.runner is not None:
                out.update(prefill_tokens=m.runner.prefill_tokens, steps=m.runner.steps,
                           stage_runs=m.stage_runs, micro_batches=m.runner.micro_batches,
                           lookahead=m.lookahead is not None,
                           exchange_bytes=m.exchange_bytes,
                           freed_param_bytes=m.freed_param_bytes,
                           activation_items=m.links.sent_items[TrafficClass.ACTIVATION],
                           activation_bytes=m.links.sent_bytes[TrafficClass.ACTIVATION],
                           bulk_bytes=m.links.sent_bytes[TrafficClass.BULK],
                           landed=0 if self._landing is None else self._landing.landed)
            return out


def _lookahead(engine, overhead_seqs: float | None) -> MemberLookahead | None:
    """§4.3's cost model of this engine's decode (Eq. (1)-(2)), or None (lookahead off)."""
    if overhead_seqs is None:
        return None
    model = engine.model
    params = layer_bytes(model.layers[0]) // model.dtype.itemsize
    return MemberLookahead(decode_cost_model(model.cfg.hidden_size, params, overhead_seqs))
