"""How a decode rank applies the driver's commands, mixed into ``DecodeRank``.

Every rank applies the same commands in the same order (lockstep, ``rank.py``): ``Reserve``
books the request's blocks in the engine and lends them to the receive manager under the
pump's lock (kept KV yields room first, and a kept prefix is shared, not streamed);
``Commit`` and ``Add`` admit a request; ``Abort`` ends it on the receive side first, then in
the engine. Elastic commands go to the rank's ``ElasticMember``.
"""

from __future__ import annotations

import time

from tetris.actors.decode.elastic import ELASTIC_COMMANDS
from tetris.actors.decode.messages import Abort, Add, Command, Commit, Rejected, Reserve

__all__ = ["RankCommands"]


class RankCommands:
    """Mixed into ``DecodeRank``: one command against the engine and the receive manager."""

    def _apply(self, cmd: Command) -> Rejected | None:
        engine = self._engine()
        rid = cmd.request_id
        try:
            if isinstance(cmd, Reserve):
                return self._reserve(cmd)
            if isinstance(cmd, Commit):
                engine.commit_prefilled(rid, cmd.first_token, cmd.first_logprob)
            elif isinstance(cmd, Add):
                engine.add_request(rid, cmd.prompt_token_ids, cmd.sampling)
            elif isinstance(cmd, Abort):
                self._abort(rid, cmd.reason)
            elif isinstance(cmd, ELASTIC_COMMANDS) and self.elastic is not None:
                return self.elastic.apply(cmd)
            else:
                raise TypeError(f"unknown decode command {type(cmd).__name__}")
        except ValueError as exc:
            return Rejected(rid, str(exc))
        return None

    def _reserve(self, cmd: Reserve) -> Rejected | None:
        engine = self._engine()
        if self.pump is None:
            return Rejected(cmd.request_id, "this decode instance has no KV transfer enabled")
        kv_tokens = len(cmd.prompt_token_ids) + len(cmd.generated) - cmd.kv_start
        kept = self._kept() if cmd.keep or cmd.prefix_tokens else None
        if cmd.prefix_tokens and not kept.covers(cmd.prefix_from, cmd.prompt_token_ids,
                                                 cmd.prefix_tokens):
            return Rejected(cmd.request_id, f"no kept KV of {cmd.prefix_from!r} holding the "
                            f"prompt's first {cmd.prefix_tokens} tokens here")
        # the kept prefix's full blocks are shared, not reserved again (kept_kv.py)
        shared = kept.shared_blocks(cmd.prefix_from, cmd.prefix_tokens) \
            if cmd.prefix_tokens else []
        if self.kept is not None and not engine.can_reserve(kv_tokens, len(shared)):
            self.kept.make_room(kv_tokens, cmd.prefix_from, len(shared))   # kept KV yields
        if not engine.can_reserve(kv_tokens, len(shared)):
            stats = engine.stats()
            return Rejected(cmd.request_id, f"{kv_tokens} prompt tokens do not fit "
                            f"{stats.free_blocks} free blocks of {stats.block_size}", full=True)
        # Under the pump's lock: no handshake may see the engine's blocks before the manager does.
        with self.pump.locked() as manager:
            table = engine.reserve_blocks(cmd.request_id, cmd.prompt_token_ids, cmd.sampling,
                                          cmd.generated, kv_start=cmd.kv_start, shared=shared)
            self._blocks.lend(table)
            try:
                ok = manager.reserve(cmd.request_id, kv_tokens, time.monotonic())
                if ok and cmd.prefix_tokens:   # shared or copied here, so not streamed
                    kept.copy_boundary(cmd.prefix_from, table, cmd.prefix_tokens)
                    manager.preset(cmd.request_id, cmd.prefix_tokens)
            finally:
                self._blocks.lend(None)
            if not ok:
                engine.abort_request(cmd.request_id)
                return Rejected(cmd.request_id, "the receive manager refused the reservation "
                                "(request id already used for a transfer)")
        if cmd.keep:
            kept.want(cmd.request_id)
        return None

    def _kept(self):
        if self.kept is None:
            from tetris.engine.kept_kv import KeptKV

            self.kept = KeptKV(self._engine())
        return self.kept

    def _abort(self, request_id: str, reason: str) -> None:
        # Receive side first, under the pump's lock: once it returns no piece can land in the
        # blocks the engine is about to free and hand to another request.
        engine = self._engine()
        if self.pump is None:
            engine.abort_request(request_id)
            if self.kept is not None:   # a kept run's KV is freed by an abort too
                self.kept.drop(request_id)
            return
        with self.pump.locked() as manager:
            manager.abort(request_id, reason, time.monotonic())
            engine.abort_request(request_id)
            if self.kept is not None:
                self.kept.drop(request_id)
            # direct writes: a granted write may still land in these blocks, so the engine
            # does not reuse them until the receive manager lets them go (transfer/direct.py)
            self._blocks.withhold(engine.blocks, manager.held_back())
