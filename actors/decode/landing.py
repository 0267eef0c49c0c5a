"""Where a dropped KunServe member lands a prefilled prompt's KV (issue #24).

The prefill pool streams every layer of a request's KV to one decode instance, but a member
of a dropped group holds only its layer range. So, while dropped, a member keeps a small
*landing zone*: whole-model KV blocks (``[kunserve] landing_blocks``, taken from its KV region
before the group's blocks are sized) that the receive manager writes into. A reservation
(``Reserve``) books the request's group blocks in the engine as usual and lends the receive
manager landing blocks instead; when the KV is complete (``RequestReady``) the member copies
its own layers into its stage cache and sends every other member its layers' KV over the
pair's priority link as bulk (``GroupMember.land``), behind the pipeline's activations; the
request is reported ready (so the driver commits it) only once every keeper wrote it, and its
landing blocks are free again. A request aborted while its layers are on the link leaves its
group blocks fenced (out of the engine's free list) until every keeper wrote them.
"""

from __future__ import annotations

import threading
import time

from tetris.actors.decode.messages import Rejected, Reserve

from tetris.engine.block_manager import BlockManager, blocks_for
from tetris.engine.kv_cache import KVCache

__all__ = ["LandingZone"]


class LandingZone:
    def __init__(self, model, num_blocks: int, block_size: int) -> None:
        self.cache = KVCache.for_model(model, num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size)
        self._tables: dict[str, list[int]] = {}     # request -> its landing blocks
        self._forwarding: dict[str, list[int]] = {}  # on the link: request -> group blocks
        self._aborted: set[str] = set()              # aborted while on the link
        self._lock = threading.Lock()               # step thread, pump thread, link threads
        self.landed = 0                              # requests forwarded to their keepers

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._tables

    def reserve(self, rank, cmd: Reserve) -> Rejected | None:
        """``RankCommands._reserve`` for a dropped member (no kept prefix, no elastic range)."""
        engine, rid = rank._engine(), cmd.request_id
        kv_tokens = len(cmd.prompt_token_ids) + len(cmd.generated)
        need = blocks_for(kv_tokens, self.blocks.block_size)
        with self._lock:
            room = need <= self.blocks.num_free_blocks
        if not room or not engine.can_reserve(kv_tokens):
            return Rejected(rid, f"{kv_tokens} prompt tokens do not fit the group's free blocks "
                            f"or the {self.blocks.num_free_blocks} free landing blocks", full=True)
        with rank.pump.locked() as manager:
            table = engine.reserve_blocks(rid, cmd.prompt_token_ids, cmd.sampling, cmd.generated)
            with self._lock:
                landing = [self.blocks.reserve(rid) for _ in table]
                self._tables[rid] = landing
            rank._blocks.lend(landing)
            try:
                ok = manager.reserve(rid, kv_tokens, time.monotonic())
            finally:
                rank._blocks.lend(None)
            if not ok:
                engine.abort_request(rid)
                self.release(rid)
                return Rejected(rid, "the receive manager refused the reservation "
                                "(request id already used for a transfer)")
        return None

    def forward(self, rank, request_id: str) -> None:
        """The request's KV is complete in the landing zone: to its layers' keepers."""
        seq = rank._engine()._seqs[request_id]
        with self._lock:
            landing = list(self._tables[request_id])
            self._forwarding[request_id] = list(seq.block_table)
            self.landed += 1
        rank.group_member.land(request_id, list(seq.block_table), self.cache, landing,
                               rank._landed)

    def abort(self, request_id: str) -> list[int] | None:
        """The group blocks of a request aborted while its layers are on the link: the
        keepers may still write them, so they stay fenced until ``landed_at``."""
        with self._lock:
            blocks = self._forwarding.get(request_id)
            if blocks is not None:
                self._aborted.add(request_id)
            return blocks

    def landed_at(self, request_id: str) -> list[int] | None:
        """Every keeper wrote it: None, or the blocks to unfence if it was aborted."""
        with self._lock:
            blocks = self._forwarding.pop(request_id, None)
            if request_id in self._aborted:
                self._aborted.discard(request_id)
                return blocks
            return None

    def release(self, request_id: str) -> None:
        """Landing blocks back (forwarded, aborted or refused); a no-op for others."""
        with self._lock:
            table = self._tables.pop(request_id, None)
            if table:
                self.blocks.free_owned(request_id, table)
