"""The receive manager of one decode instance (protocol: ``protocol.py``).

Driven by its owner, never blocking:

    mgr.deliver(msg, now)      # Handshake / Abort from a sender (routed through Ray)
    events = mgr.poll(now)     # reads backend notifications, places pieces, hands out grants,
                               # checks timeouts; returns RequestReady / ChunkArrived / ...
    for env in mgr.drain_outbox(): route env.msg to sender env.dst_id

``on_event`` (optional) is called with each event as well, e.g. to set an asyncio event.
The decode instance's block pool it allocates from is a ``block_allocator.BlockAllocator``;
what it refuses of a handshake or a piece is ``receive_checks.py``'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tetris.config import TransferConfig
from tetris.kernels.kv_pack import packed_bytes_per_token
from tetris.kernels.kv_pack_dispatch import scatter_kv   # Triton on CUDA caches
from tetris.transfer.backends.base import TransferAgent
from tetris.transfer.block_allocator import BlockAllocator
from tetris.transfer.direct import BlockHolds, register_cache
from tetris.transfer.messages import (Abort, FirstToken, ControlMessage, DirectTarget, Envelope, Grant, Handshake,
                                      LayersReady, PieceNotice, TransferError, decode_notice)
from tetris.transfer.protocol import (IncomingRequest, IncomingShard, ReceiveBackend, assign_backends,
                                      shard_positions)
from tetris.transfer.receive_checks import check_handshake, check_piece
from tetris.transfer.states import (ChunkArrived, FirstTokenIn, MessageRejected, RequestReady, TransferEvent,
                                    TransferFailed, TransferState)

__all__ = ["PRESET_CHUNK", "ReceiveManager"]

# The chunk index ``preset`` counts its positions under (the prefill's cached prefix is -1).
PRESET_CHUNK = -2


class ReceiveManager:
    def __init__(self, receiver_id: int, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 allocator: BlockAllocator, agent: TransferAgent, config: TransferConfig,
                 on_event: Callable[[TransferEvent], None] | None = None) -> None:
        if not kv_caches:
            raise ValueError("the receive manager needs the KV cache of at least one layer")
        k0 = kv_caches[0][0]
        self.receiver_id = receiver_id
        self.kv_caches = list(kv_caches)
        self.num_layers = len(self.kv_caches)
        self.block_size, self.kv_heads, self.head_dim = k0.shape[1], k0.shape[2], k0.shape[3]
        self.dtype = k0.dtype
        self.bytes_per_token = packed_bytes_per_token(self.kv_heads, self.head_dim, self.dtype)
        self.allocator = allocator
        self.agent = agent
        self.config = config
        self.on_event = on_event
        self.backends = []
        for i in range(config.num_backends):
            buf = torch.zeros(config.backend_buffer_bytes, dtype=torch.uint8, device=k0.device)
            self.backends.append(ReceiveBackend(i, buf, agent.register(buf), config.backend_slots))
        self.piece_tokens = config.slot_bytes // self.bytes_per_token
        # direct writes (transfer/direct.py): the cache itself is registered, and the blocks of
        # an aborted request wait in ``_holds`` until no granted write can land in them
        self._cache_regions = (register_cache(agent, self.kv_caches) if config.direct_writes
                               else None)
        self._holds = BlockHolds()
        self.requests: dict[str, IncomingRequest] = {}
        # finished request id -> "done" / failure reason, oldest first; remembered so that a late
        # message of a finished request is refused rather than allocated anew, and bounded
        # because a long-running instance finishes requests forever
        self._closed: dict[str, str] = {}
        self._sender_agents: dict[int, str] = {}
        self._seq = itertools.count()
        self._outbox: list[Envelope] = []
        self._events: list[TransferEvent] = []

    # ---- owner API -------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_tokens: int, now: float) -> bool:
        """Allocate the request's blocks ahead of its first handshake (e.g. by the router)."""
        return self._get_or_create(request_id, prompt_tokens, now) is not None

    def preset(self, request_id: str, upto: int) -> None:
        """Positions ``[0, upto)`` of every layer are already in the request's blocks (copied
        from a kept run: prefix caching's decode side); no shard may claim them."""
        req = self.requests[request_id]
        if not 0 < upto < req.prompt_tokens or req.shards:
            raise ValueError(f"{request_id}: cannot preset [0, {upto}) of {req.prompt_tokens} "
                             f"positions with {len(req.shards)} shards open")
        req.claimed[:upto] = True
        for layer in range(req.coverage.shape[0]):
            req.cover(layer, np.arange(upto), PRESET_CHUNK)

    def deliver(self, msg: ControlMessage, now: float) -> None:
        if isinstance(msg, Handshake):
            self._on_handshake(msg, now)
        elif isinstance(msg, LayersReady):
            req = self.requests.get(msg.request_id)
            shard = None if req is None else req.shards.get((msg.sender_id, msg.chunk_index))
            if shard is None or not 0 <= msg.ready_layers <= self.num_layers:
                self._reject(msg.request_id, msg.sender_id, msg.chunk_index,
                             f"LayersReady({msg.ready_layers}) for an unknown shard or past the last layer", now)
            else:
                shard.ready_layers = max(shard.ready_layers, msg.ready_layers)
        elif isinstance(msg, Abort):
            req = self.requests.get(msg.request_id)
            if req is not None:
                self._fail(req, f"aborted by {msg.origin} {msg.origin_id}: {msg.reason}", now, notify=msg.origin_id)
        elif isinstance(msg, FirstToken):
            # It may overtake the last pieces or follow them (the request is then closed as
            # done); a failed or unknown request's owner has no use for it.
            if msg.request_id in self.requests or self._closed.get(msg.request_id) == "done":
                self._emit(FirstTokenIn(request_id=msg.request_id, token=msg.token,
                                        logprob=msg.logprob))
        else:
            raise TypeError(f"a receive manager does not take {type(msg).__name__}")

    def abort(self, request_id: str, reason: str, now: float) -> None:
        """Cancel a request (client gone, decode instance draining): frees blocks and backends."""
        req = self.requests.get(request_id)
        if req is not None:
            self._fail(req, reason, now)

    def peer_lost(self, sender_id: int, now: float) -> None:
        """A prefill instance died: every request still waiting on one of its shards fails."""
        for req in sorted(self.requests.values(), key=lambda r: r.request_id):
            if any(s.key[0] == sender_id and not s.done for s in req.shards.values()):
                self._fail(req, f"prefill instance {sender_id} lost", now, notify=sender_id)

    def poll(self, now: float) -> list[TransferEvent]:
        for peer, raw in self.agent.notifications():
            self._on_notice(peer, raw, now)
        # an allocator that only lends its owner's blocks takes held ones back its own way
        release = getattr(self.allocator, "release_held", self.allocator.free)
        for blocks in self._holds.release(now):
            release(blocks)
        served = {b.holder for b in self.backends} | {c[0] for b in self.backends for c in b.credits.values()}
        for req in sorted(self.requests.values(), key=lambda r: r.request_id):
            if req.first_seq is None or req.request_id not in served:
                # reserved before its prefill started, or queued for a backend: waiting in
                # line is not a stall (the owner aborts cancelled requests)
                req.last_progress = now
            elif now - req.last_progress > self.config.timeout_s:
                self._fail(req, f"timed out after {self.config.timeout_s:g}s without progress", now)
        for backend, slot, req, shard in assign_backends(self.backends, self.requests, self.config, now):
            req.state = TransferState.TRANSFERRING
            self._send(shard.key[0], Grant(request_id=req.request_id, sender_id=shard.key[0],
                                           chunk_index=shard.key[1], backend_id=backend.backend_id,
                                           region=backend.region, max_piece_bytes=backend.slot_bytes,
                                           receiver_id=self.receiver_id, slot=slot,
                                           offset=slot * backend.slot_bytes,
                                           target=self._direct_target(req, shard)))
        events, self._events = self._events, []
        return events

    def drain_outbox(self) -> list[Envelope]:
        out, self._outbox = self._outbox, []
        return out

    def needs_polling(self) -> bool:
        """A granted piece may land: its notice comes through the backend, seen only by
        polling. Handshakes, computed layers and aborts arrive through ``deliver``."""
        return any(b.credits for b in self.backends) or bool(self._holds)

    def idle(self) -> bool:
        """No request is held, so no timeout runs and no piece can land for one: the owner's
        pump sleeps until a message or an owner call (``reserve``) wakes it."""
        return not self.requests and not any(b.credits for b in self.backends) and not self._holds

    def state(self, request_id: str) -> TransferState | None:
        req = self.requests.get(request_id)
        if req is not None:
            return req.state
        closed = self._closed.get(request_id)
        if closed is None:
            return None
        return TransferState.DONE if closed == "done" else TransferState.FAILED

    def held_back(self) -> list[int]:
        """Blocks of aborted requests still held for writes that may land (direct writes)."""
        return self._holds.blocks

    def close(self) -> None:
        for b in self.backends:
            self.agent.deregister(b.buffer)
        if self._cache_regions is not None:
            for k, v in self.kv_caches:
                self.agent.deregister(k)
                self.agent.deregister(v)

    # ---- direct writes ---------------------------------------------------------------------
    def _direct_target(self, req: IncomingRequest, shard: IncomingShard) -> DirectTarget | None:
        """The shard's first grant tells the sender where its pieces go (direct writes)."""
        if self._cache_regions is None or shard.target_sent:
            return None
        shard.target_sent = True
        return DirectTarget(k_regions=self._cache_regions[0], v_regions=self._cache_regions[1],
                            row_bytes=self.bytes_per_token // 2, block_size=self.block_size,
                            blocks=tuple(req.blocks))

    # ---- handshake -------------------------------------------------------------------------
    def _get_or_create(self, request_id: str, prompt_tokens: int, now: float) -> IncomingRequest | None:
        req = self.requests.get(request_id)
        if req is not None:
            return req if req.prompt_tokens == prompt_tokens else None
        blocks = self.allocator.allocate(math.ceil(prompt_tokens / self.block_size))
        if blocks is None:
            return None
        req = IncomingRequest(request_id, prompt_tokens, self.num_layers, blocks, self.block_size, now)
        self.requests[request_id] = req
        return req

    def _on_handshake(self, hs: Handshake, now: float) -> None:
        reason = check_handshake(self, hs)
        positions = None
        if reason is None:
            try:
                positions = shard_positions(hs)
            except ValueError as exc:
                reason = str(exc)
        req = None
        if reason is None:
            req = self._get_or_create(hs.request_id, hs.prompt_tokens, now)
            if req is None:
                reason = "no KV blocks free, or prompt length differs from the reservation"
        if reason is None and ((hs.sender_id, hs.chunk_index) in req.shards or req.claimed[positions].any()):
            reason = "duplicate shard: its positions were already claimed by another handshake"
        if reason is not None:
            self._reject(hs.request_id, hs.sender_id, hs.chunk_index, reason, now, handshake=True)
            return
        shard = IncomingShard(hs, positions, next(self._seq), self.piece_tokens)
        req.shards[shard.key] = shard
        req.claimed[positions] = True
        req.chunks.setdefault(hs.chunk_index, (hs.chunk_start, hs.chunk_end))
        if req.first_seq is None:
            req.first_seq = shard.seq
            req.state = TransferState.WAITING
        req.last_progress = now
        self._sender_agents[hs.sender_id] = hs.agent

    # ---- pieces ----------------------------------------------------------------------------
    def _on_notice(self, peer: str, raw: bytes, now: float) -> None:
        try:
            n = decode_notice(raw)
        except ValueError as exc:
            self._emit(MessageRejected(request_id="", sender_id=-1, reason=f"malformed notice: {exc}"))
            return
        backend = self.backends[n.backend_id] if 0 <= n.backend_id < len(self.backends) else None
        if backend is not None and n.slot in backend.fenced and n.slot not in backend.credits:
            del backend.fenced[n.slot]   # the straggler of an aborted request has landed
            self._holds.landed(n.backend_id, n.slot)
        reason, shard = check_piece(self, peer, n)
        if reason is not None:
            if shard is not None:         # the credit was spent on a bad piece; grant again
                self._spend(backend, n.slot, shard)
            self._reject(n.request_id, n.sender_id, n.chunk_index, reason, now)
            return
        req = self.requests[n.request_id]
        self._place(req, shard, n, backend)
        self._spend(backend, n.slot, shard)
        req.last_progress = now
        self._check_complete(req, shard, n.layer)

    def _place(self, req: IncomingRequest, shard: IncomingShard, n: PieceNotice, backend: ReceiveBackend) -> None:
        piece = slice(n.token_offset, n.token_offset + n.num_tokens)
        if self._cache_regions is None:
            # staging bytes -> [num_tokens, 2, Hkv, D] -> paged cache slots of their positions
            packed = backend.slot_view(n.slot, n.nbytes).view(self.dtype).view(
                n.num_tokens, 2, self.kv_heads, self.head_dim)
            slots = shard.slots(req.block_table, self.block_size)[piece]
            k_cache, v_cache = self.kv_caches[n.layer]
            scatter_kv(k_cache, v_cache, slots, packed)
        # (direct writes: the bytes are already in the request's blocks)
        shard.mark_received(n.layer, n.token_offset, n.num_tokens)
        req.cover(n.layer, shard.positions[piece], shard.key[1])

    @staticmethod
    def _spend(backend: ReceiveBackend, slot: int, shard: IncomingShard) -> None:
        del backend.credits[slot]
        shard.outstanding -= 1

    def _check_complete(self, req: IncomingRequest, shard: IncomingShard, layer: int) -> None:
        chunk = shard.key[1]
        if chunk not in req.chunks_done and req.chunk_complete(chunk):
            req.chunks_done.append(chunk)
            self._emit(ChunkArrived(request_id=req.request_id, chunk_index=chunk))
        if req.complete:
            req.state = TransferState.DONE
            del self.requests[req.request_id]
            self._close(req.request_id, "done")
            self._emit(RequestReady(request_id=req.request_id, prompt_tokens=req.prompt_tokens,
                                    block_table=list(req.blocks)))

    # ---- failure ---------------------------------------------------------------------------
    def _fail(self, req: IncomingRequest, reason: str, now: float, notify: int | None = None) -> None:
        req.state = TransferState.FAILED
        outstanding = set()
        for b in self.backends:
            for slot in [s for s, c in sorted(b.credits.items()) if c[0] == req.request_id]:
                # a piece may still be on the wire into this slot: keep it out of use a while
                del b.credits[slot]
                b.fenced[slot] = now + self.config.abort_grace_s
                outstanding.add((b.backend_id, slot))
            if b.holder == req.request_id:
                b.free()
        if self._cache_regions is not None and outstanding:
            # a granted direct write may still land in these blocks: not reused until it has
            self._holds.hold(req.blocks, outstanding, now + self.config.abort_grace_s)
        else:
            self.allocator.free(req.blocks)
        del self.requests[req.request_id]
        self._close(req.request_id, reason)
        for sender in sorted({k[0] for k in req.shards}):
            if sender != notify:
                self._send(sender, Abort(request_id=req.request_id, reason=reason, origin="receiver",
                                         origin_id=self.receiver_id))
        self._emit(TransferFailed(request_id=req.request_id, reason=reason))

    def _close(self, request_id: str, outcome: str) -> None:
        self._closed[request_id] = outcome
        while len(self._closed) > self.config.closed_memory:
            del self._closed[next(iter(self._closed))]

    def _reject(self, request_id: str, sender_id: int, chunk_index: int, reason: str, now: float,
                *, handshake: bool = False) -> None:
        self._send(sender_id, TransferError(request_id=request_id, sender_id=sender_id,
                                            chunk_index=chunk_index, reason=reason,
                                            receiver_id=self.receiver_id))
        self._emit(MessageRejected(request_id=request_id, sender_id=sender_id, reason=reason))
        req = self.requests.get(request_id)
        if req is None:
            return
        shard = req.shards.get((sender_id, chunk_index))
        if handshake or (shard is not None and not shard.done):
            # The sender fails that shard on the error and never sends the rest of it (a refused
            # handshake's tokens never come at all), so the request cannot complete here: fail
            # it now, freeing its blocks and telling its senders, not at the stall timeout.
            self._fail(req, f"prefill {sender_id} chunk {chunk_index} rejected: {reason}", now)

    def _send(self, sender_id: int, msg: ControlMessage) -> None:
        self._outbox.append(Envelope(dst_role="sender", dst_id=sender_id, msg=msg))

    def _emit(self, event: TransferEvent) -> None:
        self._events.append(event)
        if self.on_event is not None:
            self.on_event(event)
