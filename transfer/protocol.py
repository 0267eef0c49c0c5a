"""The KV transfer protocol (SPEC 7, paper §4.2 and Fig. 7) and its backend allocation.

Lifecycle of one request whose KV lies on several prefill instances:

1. The dispatcher sends a chunk to its prefill group; each member hands its shard (absolute
   positions it computes) to its ``SendManager.add_shard`` while compute starts.
2. The send manager sends a ``Handshake`` to the decode instance's ``ReceiveManager``. The first
   handshake of a request stamps its order and allocates its KV blocks (unless ``reserve`` did).
3. The receive manager grants receive backends (staging buffers), one ``Grant`` = one piece
   into one slot of a backend's buffer (``backend_slots`` per backend, so a shard may hold
   several credits and stream without waiting a control round trip per piece):
   - dedicated mode (``num_backends >= pool_size``, the "enough backends" case): backend ``i``
     belongs to prefill instance ``i`` and serves its shards, oldest request first;
   - ordered mode (scarce backends): a free backend goes to the active request with the
     earliest first handshake that holds none, and stays with it until all its chunks have
     arrived, even while it waits for a later chunk's handshake. A request that started
     arriving therefore always finishes; no half-filled request holds decode memory forever.
4. As each layer finishes (``SendManager.layer_ready``), the sender says so (``LayersReady``;
   grants go only to shards with data waiting) and writes it piece by piece into the granted
   buffer with a ``PieceNotice`` on the backend's notification; the receiver
   checks it, places it into its paged cache by absolute position (``kernels/kv_pack``) and
   grants the next piece. Bulk pieces yield to activations at piece boundaries (``traffic``).
5. When all layers of ``[0, prompt_tokens)`` have arrived, ``poll`` returns ``RequestReady``
   and the blocks pass to the decode engine, which adds the request at its next iteration.

Errors: a bad handshake or piece is rejected (``MessageRejected`` + ``TransferError`` to the
sender) and writes nothing. Abort, timeout (no progress for ``timeout_s`` on the passed-in
clock) or a lost peer fail the request: blocks and backends are freed, peers get ``Abort``.

This module holds the receiver's bookkeeping and the backend choice; it does no I/O.
"""

from __future__ import annotations

import numpy as np
import torch

from tetris.config import TransferConfig
from tetris.kernels.kv_pack import positions_to_slots
from tetris.transfer.messages import Handshake, RegionDesc
from tetris.transfer.states import TransferState

__all__ = ["IncomingShard", "IncomingRequest", "ReceiveBackend", "assign_backends", "shard_positions"]

ShardKey = tuple[int, int]   # (sender_id, chunk_index)


def shard_positions(handshake: Handshake) -> np.ndarray:
    """The shard's absolute positions in packed order; raises ValueError if the ranges are bad."""
    last = handshake.chunk_start
    parts = []
    for r in handshake.ranges:
        if r.start < last or r.end <= r.start:
            raise ValueError(f"ranges must be sorted, disjoint and non-empty, got {list(handshake.ranges)}")
        parts.append(np.arange(r.start, r.end, dtype=np.int64))
        last = r.end
    if not parts:
        raise ValueError("a shard needs at least one token range")
    if last > handshake.chunk_end or handshake.chunk_end > handshake.prompt_tokens:
        raise ValueError(
            f"shard ranges end at {last}, chunk [{handshake.chunk_start}, {handshake.chunk_end}) "
            f"of a {handshake.prompt_tokens}-token prompt"
        )
    return np.concatenate(parts)


class IncomingShard:
    def __init__(self, handshake: Handshake, positions: np.ndarray, seq: int, piece_tokens: int) -> None:
        self.handshake = handshake
        self.key: ShardKey = (handshake.sender_id, handshake.chunk_index)
        self.positions = positions
        self.positions_t = torch.from_numpy(positions)
        self.received = np.zeros((handshake.num_layers, positions.size), dtype=bool)
        self.received_tokens = np.zeros(handshake.num_layers, dtype=np.int64)   # per layer
        self.seq = seq   # arrival order of this shard's own handshake
        self.ready_layers = 0   # layers [0, ready_layers) are computed on the sender
        # The most tokens one piece can carry (a slot's bytes); a sender may cut smaller pieces,
        # which only makes ``pieces_wanted`` an underestimate: a credit is never granted idle.
        self.piece_tokens = max(1, piece_tokens)
        self.outstanding = 0    # credits granted and not yet used
        self.target_sent = False   # direct writes: its first grant carried the cache target
        self._slots: torch.Tensor | None = None

    def slots(self, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
        """The cache slot of each of the shard's positions through the request's block table
        (fixed once the request is reserved), computed and checked on the first piece only:
        a piece's slots are then a slice of it."""
        if self._slots is None:
            self._slots = positions_to_slots(block_table, self.positions_t, block_size)
        return self._slots

    def mark_received(self, layer: int, token_offset: int, num_tokens: int) -> None:
        self.received[layer, token_offset:token_offset + num_tokens] = True
        self.received_tokens[layer] += num_tokens

    @property
    def done(self) -> bool:
        return bool((self.received_tokens == self.positions.size).all())

    @property
    def pieces_wanted(self) -> int:
        """Pieces of computed layers not yet arrived: how many credits could be used now."""
        pending = self.positions.size - self.received_tokens[:self.ready_layers]
        return int(((pending + self.piece_tokens - 1) // self.piece_tokens).sum())

    @property
    def has_data(self) -> bool:
        """A computed piece has no credit yet: one more credit would be used at once."""
        return self.pieces_wanted > self.outstanding


class IncomingRequest:
    def __init__(self, request_id: str, prompt_tokens: int, num_layers: int, blocks: list[int],
                 block_size: int, now: float) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.blocks = blocks
        self.block_table = torch.tensor(blocks, dtype=torch.int32)
        self.block_size = block_size
        self.coverage = np.zeros((num_layers, prompt_tokens), dtype=bool)
        # (layer, position) pairs covered, in all and per chunk: completion is read from
        # counts, and ``coverage`` scanned only to confirm it (once per chunk, not per piece)
        self.covered = 0
        self.chunk_covered: dict[int, int] = {}
        self.claimed = np.zeros(prompt_tokens, dtype=bool)
        self.shards: dict[ShardKey, IncomingShard] = {}
        self.chunks: dict[int, tuple[int, int]] = {}
        self.chunks_done: list[int] = []
        self.first_seq: int | None = None    # order of the first handshake (SPEC 7 step 3)
        self.state = TransferState.BOOTSTRAPPING
        self.last_progress = now

    def cover(self, layer: int, positions: np.ndarray, chunk: int) -> None:
        """Positions of ``layer`` arrived (from a shard of ``chunk``)."""
        row = self.coverage[layer]
        new = positions.size - int(np.count_nonzero(row[positions]))
        row[positions] = True
        self.covered += new
        self.chunk_covered[chunk] = self.chunk_covered.get(chunk, 0) + new

    def chunk_complete(self, chunk: int) -> bool:
        start, end = self.chunks[chunk]
        return (self.chunk_covered.get(chunk, 0) >= self.coverage.shape[0] * (end - start)
                and bool(self.coverage[:, start:end].all()))

    @property
    def complete(self) -> bool:
        return self.covered >= self.coverage.size and bool(self.coverage.all())

    def sorted_shards(self) -> list[IncomingShard]:
        return [self.shards[k] for k in sorted(self.shards, key=lambda k: (k[1], k[0]))]


class ReceiveBackend:
    """One staging buffer, cut into ``num_slots`` slots, and who may write into each."""

    def __init__(self, backend_id: int, buffer: torch.Tensor, region: RegionDesc, num_slots: int = 1) -> None:
        self.backend_id = backend_id
        self.buffer = buffer               # uint8 [backend_buffer_bytes]
        self.region = region
        self.num_slots = num_slots
        self.slot_bytes = buffer.numel() // num_slots
        self.holder: str | None = None     # ordered mode: request id; per-chunk: request id of holder_shard
        self.holder_shard: ShardKey | None = None
        self.credits: dict[int, tuple[str, ShardKey]] = {}   # slot -> the piece it may receive next
        self.last_served: ShardKey | None = None
        # slot -> until when it stays unused: after an abort, a piece may still be on the wire
        self.fenced: dict[int, float] = {}

    def slot_view(self, slot: int, nbytes: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self.buffer[start:start + nbytes]

    def free_slots(self, now: float) -> list[int]:
        for slot, until in sorted(self.fenced.items()):
            if now >= until:
                del self.fenced[slot]
        return [i for i in range(self.num_slots) if i not in self.credits and i not in self.fenced]

    def free(self) -> None:
        self.holder = None
        self.holder_shard = None
        self.last_served = None


def _active(requests: dict[str, IncomingRequest]) -> list[IncomingRequest]:
    live = [r for r in requests.values() if r.first_seq is not None and not r.state.finished]
    return sorted(live, key=lambda r: r.first_seq)


def _round_robin(shards: list[IncomingShard], after: ShardKey | None) -> IncomingShard | None:
    pending = [s for s in shards if s.has_data]
    if not pending:
        return None
    if after is not None:
        keys = [(s.key[1], s.key[0]) for s in pending]
        later = [s for s, k in zip(pending, keys) if k > (after[1], after[0])]
        if later:
            return later[0]
    return pending[0]


def _dedicated(backend: ReceiveBackend, live: list[IncomingRequest]) -> tuple[IncomingRequest, IncomingShard] | None:
    for req in live:
        mine = [s for s in req.sorted_shards() if s.key[0] == backend.backend_id]
        shard = _round_robin(mine, None)
        if shard is not None:
            return req, shard
    return None


def _ordered(backend: ReceiveBackend, live: list[IncomingRequest],
             held: set[str]) -> tuple[IncomingRequest, IncomingShard] | None:
    if backend.holder is None:
        waiting = [r for r in live if r.request_id not in held]
        if not waiting:
            return None
        backend.holder = waiting[0].request_id
        held.add(backend.holder)
    req = next((r for r in live if r.request_id == backend.holder), None)
    if req is None:
        return None
    shard = _round_robin(req.sorted_shards(), backend.last_served)
    return None if shard is None else (req, shard)


def _per_chunk_fcfs(backend: ReceiveBackend, live: list[IncomingRequest],
                    held: set[ShardKey | tuple]) -> tuple[IncomingRequest, IncomingShard] | None:
    # The naive baseline: a backend serves one shard at a time, shards by their own handshake
    # order, with no regard for which request they complete.
    if backend.holder_shard is not None:
        req = next((r for r in live if r.request_id == backend.holder), None)
        shard = None if req is None else req.shards.get(backend.holder_shard)
        if shard is not None and not shard.done:
            return (req, shard) if shard.has_data else None
        backend.free()
    candidates = [(s.seq, r, s) for r in live for s in r.shards.values()
                  if not s.done and (r.request_id, s.key) not in held]
    if not candidates:
        return None
    _, req, shard = min(candidates, key=lambda c: c[0])
    backend.holder, backend.holder_shard = req.request_id, shard.key
    held.add((req.request_id, shard.key))
    return (req, shard) if shard.has_data else None


def assign_backends(backends: list[ReceiveBackend], requests: dict[str, IncomingRequest], config: TransferConfig,
                    now: float) -> list[tuple[ReceiveBackend, int, IncomingRequest, IncomingShard]]:
    """Credits to hand out now, ``(backend, slot, request, shard)``, one per idle, unfenced slot
    that a computed piece can use; they are recorded on the backend and the shard."""
    live = _active(requests)
    live_ids = {r.request_id for r in live}
    for b in backends:
        if b.holder is not None and b.holder not in live_ids:
            b.free()
    if config.policy == "per_chunk_fcfs":
        held: set = {(b.holder, b.holder_shard) for b in backends if b.holder_shard is not None}
    else:
        held = {b.holder for b in backends if b.holder is not None}
    grants = []
    for b in backends:
        for slot in b.free_slots(now):
            if config.policy == "per_chunk_fcfs":
                pick = _per_chunk_fcfs(b, live, held)
            elif config.dedicated_backends:
                pick = _dedicated(b, live)
            else:
                pick = _ordered(b, live, held)
            if pick is None:
                break
            req, shard = pick
            b.credits[slot] = (req.request_id, shard.key)
            b.last_served = shard.key
            shard.outstanding += 1
            grants.append((b, slot, req, shard))
    return grants
