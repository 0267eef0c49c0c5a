"""The send manager of one prefill instance (protocol: ``protocol.py``).

Driven by its owner (the prefill worker actor), never blocking:

    mgr.add_shard(...)                       # step 1: at chunk dispatch, before compute
    mgr.layer_ready(rid, chunk, layer, kv)   # step 4: as each layer's KV is computed
                                             # (receiver_id=r when the chunk goes to several)
    mgr.deliver(msg, now)                    # Grant / Abort / TransferError from the receiver
    events = mgr.poll(now)                   # posts and checks writes, timeouts
    for env in mgr.drain_outbox(): route env.msg to receiver env.dst_id

A shard is keyed by (request, chunk, receiver): one chunk computed here may stream to several
receivers, e.g. the TP ranks of a decode instance, each taking its own slice of the KV heads.

One write is on the link at a time; the link (``traffic.LinkScheduler``) is shared with the
owner's activation sends (``submit_activation``), which go first at every piece boundary.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from tetris.config import TransferConfig
from tetris.kernels.kv_pack import packed_bytes_per_token
from tetris.transfer.backends.base import TransferAgent
from tetris.transfer.direct import piece_descriptors, shard_positions_of, stage_split_rows
from tetris.transfer.messages import (Abort, ControlMessage, DirectTarget, Envelope, FirstToken, Grant, Handshake,
                                      LayersReady, PieceNotice, TokenRange, TransferError, encode_notice)
from tetris.transfer.states import ActivationGo, ShardSent, TransferEvent, TransferFailed, TransferState
from tetris.transfer.traffic import LinkChunk, LinkScheduler, TrafficClass

__all__ = ["SendManager", "ShardKey"]

ShardKey = tuple[str, int, int]   # (request_id, chunk_index, receiver_id)


class _OutgoingShard:
    def __init__(self, handshake: Handshake, num_tokens: int, now: float) -> None:
        self.handshake = handshake
        self.num_tokens = num_tokens
        self.layers: dict[int, torch.Tensor] = {}   # layer -> [num_tokens, 2, Hkv, D]
        self.grants: deque[Grant] = deque()   # credits in the order they came, one piece each
        self.layer = 0           # cursor: next piece starts at (layer, offset)
        self.offset = 0
        self.queued = False      # its next piece waits on the link
        self.ready_layers = 0    # layers [0, ready_layers) were handed over (told to the receiver)
        self.state = TransferState.BOOTSTRAPPING
        self.last_progress = now
        self.target: DirectTarget | None = None   # direct writes: from the first grant
        self._positions: np.ndarray | None = None

    def positions(self) -> np.ndarray:
        """Absolute positions in packed order (direct writes place pieces by them)."""
        if self._positions is None:
            self._positions = shard_positions_of(self.handshake.ranges)
        return self._positions

    @property
    def key(self) -> ShardKey:
        hs = self.handshake
        return (hs.request_id, hs.chunk_index, hs.receiver_id)

    @property
    def tag(self) -> str:
        hs = self.handshake
        return f"{hs.request_id}/{hs.chunk_index}/{hs.receiver_id}"


class SendManager:
    def __init__(self, sender_id: int, agent: TransferAgent, config: TransferConfig,
                 device: str | torch.device = "cpu") -> None:
        self.sender_id = sender_id
        self.agent = agent
        self.config = config
        self.link = LinkScheduler(min(config.bulk_chunk_bytes, config.send_buffer_bytes))
        self._staging = torch.zeros(config.send_buffer_bytes, dtype=torch.uint8, device=device)
        agent.register(self._staging)
        self.shards: dict[ShardKey, _OutgoingShard] = {}
        self._in_flight: tuple[LinkChunk, _OutgoingShard, PieceNotice, object] | None = None
        self._outbox: list[Envelope] = []
        self._events: list[TransferEvent] = []

    # ---- owner API -------------------------------------------------------------------------
    def add_shard(self, *, request_id: str, chunk_index: int, receiver_id: int, prompt_tokens: int,
                  chunk: tuple[int, int], ranges: Sequence[tuple[int, int]], num_layers: int,
                  kv_heads: int, head_dim: int, dtype: torch.dtype, now: float) -> None:
        """This instance computes ``ranges`` (absolute positions) of the chunk; handshake now."""
        key = (request_id, chunk_index, receiver_id)
        if key in self.shards:
            raise ValueError(f"shard {key} was already added")
        token_ranges = tuple(TokenRange(int(a), int(b)) for a, b in ranges)
        hs = Handshake(request_id=request_id, sender_id=self.sender_id, receiver_id=receiver_id,
                       chunk_index=chunk_index, chunk_start=int(chunk[0]), chunk_end=int(chunk[1]),
                       prompt_tokens=prompt_tokens, ranges=token_ranges, num_layers=num_layers,
                       kv_heads=kv_heads, head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
                       agent=self.agent.name)
        n = sum(r.end - r.start for r in token_ranges)
        if n <= 0:
            raise ValueError(f"shard {key} has no tokens")
        self.shards[key] = _OutgoingShard(hs, n, now)
        self._send(receiver_id, hs)

    def layer_ready(self, request_id: str, chunk_index: int, layer: int, kv: torch.Tensor,
                    receiver_id: int | None = None) -> None:
        """Layer ``layer``'s KV of the shard, ``[n, 2, Hkv, D]`` in the order of its ranges.

        ``receiver_id`` None means the chunk's only receiver. The tensor is read until the layer
        is sent; do not write to it afterwards.
        """
        shard = self.shards[self._resolve(request_id, chunk_index, receiver_id)]
        hs = shard.handshake
        want = (shard.num_tokens, 2, hs.kv_heads, hs.head_dim)
        if tuple(kv.shape) != want or str(kv.dtype).removeprefix("torch.") != hs.dtype:
            raise ValueError(f"layer KV must be {want} {hs.dtype}, got {tuple(kv.shape)} {kv.dtype}")
        if not 0 <= layer < hs.num_layers or layer in shard.layers or layer < shard.layer:
            raise ValueError(f"layer {layer} is out of range or was already given")
        shard.layers[layer] = kv.contiguous()
        ready = shard.ready_layers
        while ready in shard.layers or ready < shard.layer:
            ready += 1
        if ready > shard.ready_layers and not shard.state.finished:
            shard.ready_layers = ready
            self._send(hs.receiver_id, LayersReady(request_id=request_id, sender_id=self.sender_id,
                                                   chunk_index=chunk_index, ready_layers=ready))

    def first_token(self, request_id: str, receivers, token: int, logprob: bytes = b"") -> None:
        """The request's first output token, sampled here: to each of ``receivers`` (the
        request's decode ranks), after this sender's handshakes to them."""
        for r in sorted(receivers):
            self._send(r, FirstToken(request_id=request_id, sender_id=self.sender_id,
                                     token=int(token), logprob=logprob))

    def deliver(self, msg: ControlMessage, now: float) -> None:
        if isinstance(msg, Grant):
            shard = self._find(msg.request_id, msg.chunk_index, msg.receiver_id)
            if shard is None or shard.state.finished or msg.sender_id != self.sender_id:
                return   # a grant for a shard this side already dropped: the receiver times it out
            shard.grants.append(msg)
            if msg.target is not None:
                shard.target = msg.target
            if shard.state != TransferState.TRANSFERRING:
                shard.state = TransferState.WAITING
                shard.last_progress = now
        elif isinstance(msg, Abort):
            # The request is gone for the aborting receiver; its other receivers (the other TP
            # ranks of that decode instance) cannot use a partial request either, so they are told.
            for key in sorted(k for k in self.shards if k[0] == msg.request_id):
                told = msg.origin == "receiver" and key[2] == msg.origin_id
                self._fail(self.shards[key], msg.reason, tell_receiver=not told)
        elif isinstance(msg, TransferError):
            # receiver_id -1: a receiver that does not name itself; every receiver of the chunk
            for key in sorted(k for k in self.shards if k[:2] == (msg.request_id, msg.chunk_index)
                              and msg.receiver_id in (-1, k[2])):
                self._fail(self.shards[key], f"rejected by receiver: {msg.reason}", tell_receiver=False)
        else:
            raise TypeError(f"a send manager does not take {type(msg).__name__}")

    def abort(self, request_id: str, reason: str) -> None:
        """Cancel every shard of a request here and tell the receiver."""
        for key in sorted(k for k in self.shards if k[0] == request_id):
            self._fail(self.shards[key], reason, tell_receiver=True)

    def peer_lost(self, receiver_id: int, now: float | None = None) -> None:
        """A decode rank died: every shard addressed to it fails (``now``: for the receive
        side's signature; a failed shard needs no clock)."""
        for key in sorted(self.shards):
            if self.shards[key].handshake.receiver_id == receiver_id:
                self._fail(self.shards[key], f"decode instance {receiver_id} lost", tell_receiver=False)

    def submit_activation(self, tag: str, nbytes: int) -> None:
        """Queue an activation send on this link; ``poll`` returns ``ActivationGo(tag)``."""
        self.link.submit(tag, nbytes, TrafficClass.ACTIVATION)

    def finish_activation(self, tag: str) -> None:
        chunk = self.link.in_flight
        if chunk is None or chunk.tag != tag or chunk.traffic_class != TrafficClass.ACTIVATION:
            raise ValueError(f"activation {tag!r} is not on the link")
        self.link.finish(chunk)

    def poll(self, now: float) -> list[TransferEvent]:
        self._check_in_flight(now)
        for key in sorted(self.shards):
            shard = self.shards[key]
            # Only a write on the wire can stall here: waiting for a grant is the receiver's
            # queue (it times out stalled requests and sends Abort), waiting for a layer is compute.
            if shard.state == TransferState.TRANSFERRING and now - shard.last_progress > self.config.timeout_s:
                self._fail(shard, f"timed out after {self.config.timeout_s:g}s without progress", tell_receiver=True)
        self._queue_ready_pieces()
        self._start_next(now)
        events, self._events = self._events, []
        return events

    def drain_outbox(self) -> list[Envelope]:
        out, self._outbox = self._outbox, []
        return out

    def needs_polling(self) -> bool:
        """A write is on the wire: only polling sees it complete. Everything else that moves
        a shard (a grant, a computed layer, an abort) arrives through ``deliver`` or an owner
        call, after which the owner polls anyway."""
        return self._in_flight is not None

    def idle(self) -> bool:
        """Nothing here can move with time alone: no write on the wire, nothing queued on the
        link, every shard finished (only a transferring shard has a timeout). Its owner's pump
        then sleeps until a message or an owner call wakes it."""
        return (self._in_flight is None and self.link.in_flight is None and not self.link.pending()
                and all(s.state.finished for s in self.shards.values()))

    def state(self, request_id: str, chunk_index: int, receiver_id: int | None = None) -> TransferState | None:
        """The shard's state (None: unknown); ``receiver_id`` None means the chunk's only one."""
        shards = self._matching(request_id, chunk_index, receiver_id)
        if len(shards) > 1:
            raise ValueError(f"chunk {chunk_index} of {request_id!r} goes to several receivers: name one")
        return shards[0].state if shards else None

    def held(self, request_id: str) -> list[ShardKey]:
        """Keys of the request's shards still held here (finished ones until ``forget``)."""
        return sorted(k for k in self.shards if k[0] == request_id)

    def forget(self, request_id: str) -> None:
        """Drop finished shards of a request (the owner calls this once it has read the events)."""
        for key in sorted(k for k in self.shards if k[0] == request_id):
            if self.shards[key].state.finished:
                del self.shards[key]

    def close(self) -> None:
        self.agent.deregister(self._staging)

    def _stage_on(self, device: torch.device) -> None:
        """Move the staging buffer to where the KV is computed (no write is on the wire: one at
        a time): on a GPU a piece is then a device-side copy and the agent registers and sends
        device memory (VRAM), with no trip through host memory."""
        self.agent.deregister(self._staging)
        self._staging = torch.zeros(self.config.send_buffer_bytes, dtype=torch.uint8, device=device)
        self.agent.register(self._staging)

    # ---- lookup ----------------------------------------------------------------------------
    def _matching(self, request_id: str, chunk_index: int, receiver_id: int | None) -> list[_OutgoingShard]:
        if receiver_id is not None:
            shard = self.shards.get((request_id, chunk_index, receiver_id))
            return [] if shard is None else [shard]
        return [self.shards[k] for k in sorted(self.shards) if k[:2] == (request_id, chunk_index)]

    def _resolve(self, request_id: str, chunk_index: int, receiver_id: int | None) -> ShardKey:
        shards = self._matching(request_id, chunk_index, receiver_id)
        if not shards:
            raise KeyError(f"no shard {(request_id, chunk_index, receiver_id)} on sender {self.sender_id}")
        if len(shards) > 1:
            raise ValueError(f"chunk {chunk_index} of {request_id!r} goes to receivers "
                             f"{[s.handshake.receiver_id for s in shards]}: name one")
        return shards[0].key

    def _find(self, request_id: str, chunk_index: int, receiver_id: int) -> _OutgoingShard | None:
        """The shard a receiver's message is about; -1 (unnamed) only if it is unambiguous."""
        shards = self._matching(request_id, chunk_index, None if receiver_id < 0 else receiver_id)
        return shards[0] if len(shards) == 1 else None

    # ---- pieces ----------------------------------------------------------------------------
    def _piece_tokens(self, shard: _OutgoingShard) -> int:
        hs = shard.handshake
        per_token = packed_bytes_per_token(hs.kv_heads, hs.head_dim, shard.layers[shard.layer].dtype)
        limit = min(shard.grants[0].max_piece_bytes, self.link.bulk_chunk_bytes)
        tokens = limit // per_token
        if tokens == 0:
            raise ValueError(f"one token ({per_token} B) does not fit a {limit} B piece")
        return min(tokens, shard.num_tokens - shard.offset)

    def _queue_ready_pieces(self) -> None:
        for key in sorted(self.shards):
            shard = self.shards[key]
            if shard.state.finished or shard.queued or not shard.grants or shard.layer not in shard.layers:
                continue
            per_token = packed_bytes_per_token(shard.handshake.kv_heads, shard.handshake.head_dim,
                                               shard.layers[shard.layer].dtype)
            self.link.submit(shard.tag, self._piece_tokens(shard) * per_token, TrafficClass.BULK)
            shard.queued = True

    def _start_next(self, now: float) -> None:
        chunk = self.link.next()
        if chunk is None:
            return
        if chunk.traffic_class == TrafficClass.ACTIVATION:
            self._events.append(ActivationGo(tag=chunk.tag))
            return
        shard = next(s for s in self.shards.values() if s.tag == chunk.tag and s.queued)
        num = self._piece_tokens(shard)
        kv = shard.layers[shard.layer][shard.offset:shard.offset + num]
        if kv.device != self._staging.device:
            self._stage_on(kv.device)
        if shard.target is None:
            src = kv.reshape(-1).view(torch.uint8)
            staging = self._staging[:src.numel()]
            staging.copy_(src)
        else:   # direct writes: K rows then V rows, placed by cache slot (transfer/direct.py)
            staging = stage_split_rows(kv, self._staging)
        g = shard.grants.popleft()
        notice = PieceNotice(request_id=g.request_id, sender_id=self.sender_id, chunk_index=g.chunk_index,
                             backend_id=g.backend_id, layer=shard.layer, token_offset=shard.offset,
                             num_tokens=num, nbytes=staging.numel(), dtype=shard.handshake.dtype, slot=g.slot)
        try:
            if shard.target is None:
                handle = self.agent.write(staging, g.region, g.offset, encode_notice(notice))
            else:
                descs = piece_descriptors(shard.target, shard.layer,
                                          shard.positions()[shard.offset:shard.offset + num])
                handle = self.agent.write_descs(staging, descs, encode_notice(notice))
        except (RuntimeError, ValueError) as exc:
            self.link.finish(chunk)
            self._fail(shard, f"write failed: {exc}", tell_receiver=True)
            return
        shard.state = TransferState.TRANSFERRING
        shard.last_progress = now
        self._in_flight = (chunk, shard, notice, handle)

    def _check_in_flight(self, now: float) -> None:
        if self._in_flight is None:
            return
        chunk, shard, notice, handle = self._in_flight
        status = self.agent.status(handle)
        if status == "proc":
            return
        self.agent.release(handle)
        self._in_flight = None
        self.link.finish(chunk)
        shard.queued = False
        if status == "err":
            self._fail(shard, "the backend reported a failed write", tell_receiver=True)
            return
        if shard.state.finished:
            return   # aborted while the piece was on the wire
        shard.last_progress = now
        shard.offset += notice.num_tokens
        if shard.offset == shard.num_tokens:
            del shard.layers[shard.layer]   # sent: the caller's tensor is no longer needed
            shard.layer, shard.offset = shard.layer + 1, 0
        if shard.layer == shard.handshake.num_layers:
            shard.state = TransferState.DONE
            self._events.append(ShardSent(request_id=notice.request_id, chunk_index=notice.chunk_index))
        else:
            shard.state = TransferState.WAITING

    def _fail(self, shard: _OutgoingShard, reason: str, *, tell_receiver: bool) -> None:
        if shard.state.finished:
            return
        shard.state = TransferState.FAILED
        shard.layers.clear()
        shard.grants.clear()
        if shard.queued and (self._in_flight is None or self._in_flight[1] is not shard):
            self.link.cancel(shard.tag)
            shard.queued = False
        hs = shard.handshake
        if tell_receiver:
            self._send(hs.receiver_id, Abort(request_id=hs.request_id, reason=reason, origin="sender",
                                             origin_id=self.sender_id))
        self._events.append(TransferFailed(request_id=hs.request_id, reason=reason, chunk_index=hs.chunk_index))

    def _send(self, receiver_id: int, msg: ControlMessage) -> None:
        self._outbox.append(Envelope(dst_role="receiver", dst_id=receiver_id, msg=msg))
