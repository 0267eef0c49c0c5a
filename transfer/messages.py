"""Every message that crosses a process boundary in KV streaming (msgspec Structs).

Control messages (``Handshake``, ``LayersReady``, ``Grant``, ``Abort``, ``TransferError``) are routed by the
managers' owners (Ray actors) in an ``Envelope``; ``PieceNotice`` rides on the data backend's
own notification (a NIXL notif), so that it arrives only after the bytes it describes.
``encode``/``decode`` give the msgpack form for transports that want bytes.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "TokenRange",
    "RegionDesc",
    "AgentInfo",
    "DirectTarget",
    "Handshake",
    "Grant",
    "PieceNotice",
    "LayersReady",
    "Abort",
    "TransferError",
    "FirstToken",
    "ControlMessage",
    "Envelope",
    "encode",
    "decode",
    "encode_notice",
    "decode_notice",
]

Role = Literal["sender", "receiver"]


class TokenRange(msgspec.Struct, frozen=True, array_like=True):
    """Absolute token positions ``[start, end)`` of a request's prompt."""

    start: int
    end: int


class RegionDesc(msgspec.Struct, frozen=True):
    """A registered memory region another agent may write into (a receive backend's buffer)."""

    agent: str
    addr: int
    nbytes: int
    device_id: int = 0
    mem: Literal["DRAM", "VRAM", "INPROC"] = "DRAM"


class AgentInfo(msgspec.Struct, frozen=True):
    """What a peer needs to reach an agent: exchanged once through Ray before any transfer."""

    name: str
    backend: str
    metadata: bytes


class Handshake(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver (SPEC 7 step 2): one prefill instance holds one shard of one chunk.

    ``ranges`` are the shard's absolute positions (sorted, disjoint); the packed KV of a layer
    lists them in that order. ``first_handshake_at`` is stamped by the receiver, not here.
    """

    request_id: str
    sender_id: int
    receiver_id: int
    chunk_index: int
    chunk_start: int
    chunk_end: int
    prompt_tokens: int
    ranges: tuple[TokenRange, ...]
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    agent: str


class LayersReady(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver: layers ``[0, ready_layers)`` of the shard are computed and may be
    sent. The receiver grants only shards with data waiting, so a backend never idles on a
    shard whose next layer is still being computed while another shard could use it."""

    request_id: str
    sender_id: int
    chunk_index: int
    ready_layers: int


class DirectTarget(msgspec.Struct, frozen=True):
    """Direct writes (transfer/direct.py): where a shard's pieces go in the decode rank's paged
    cache: per layer its registered K and V cache regions (``[num_blocks, block_size, Hkv, D]``
    each), the bytes of one slot row (``Hkv x D x element size``), the request's block table."""

    k_regions: tuple[RegionDesc, ...]
    v_regions: tuple[RegionDesc, ...]
    row_bytes: int
    block_size: int
    blocks: tuple[int, ...]


class Grant(msgspec.Struct, frozen=True, tag=True):
    """Receiver -> sender (SPEC 7 step 3): one credit to write one piece of at most
    ``max_piece_bytes`` into ``region`` at ``offset`` (slot ``slot`` of the backend's buffer).
    A shard may hold several credits at once (one per slot), used in the order they came."""

    request_id: str
    sender_id: int
    chunk_index: int
    backend_id: int
    region: RegionDesc
    max_piece_bytes: int
    receiver_id: int = -1   # the granting receiver: a chunk may stream to several (TP ranks)
    slot: int = 0
    offset: int = 0
    # direct writes: on a shard's first grant, where its pieces go (then the slot is a credit
    # only and its bytes stay unused)
    target: DirectTarget | None = None


class PieceNotice(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver with the data: tokens ``[token_offset, +num_tokens)`` of the shard
    (in its packed order) for ``layer`` now lie at the start of slot ``slot`` of backend
    ``backend_id``'s region (the grant's ``offset``)."""

    request_id: str
    sender_id: int
    chunk_index: int
    backend_id: int
    layer: int
    token_offset: int
    num_tokens: int
    nbytes: int
    dtype: str
    slot: int = 0


class Abort(msgspec.Struct, frozen=True, tag=True):
    """Either side: forget ``request_id``; every buffer and block of it is freed."""

    request_id: str
    reason: str
    origin: Role
    origin_id: int


class TransferError(msgspec.Struct, frozen=True, tag=True):
    """Receiver -> sender: a message of this shard was rejected; nothing was written."""

    request_id: str
    sender_id: int
    chunk_index: int
    reason: str
    receiver_id: int = -1   # the rejecting receiver; -1: every receiver of the chunk


class FirstToken(msgspec.Struct, frozen=True, tag=True):
    """Sender -> every receiver of the request: the first output token, sampled by the member
    holding the prompt's last token, so that decoding starts once the KV and this are in,
    without a hop through the dispatcher. ``logprob``: the msgpack of the engine's
    ``TokenLogprob`` when the request asked for logprobs (opaque to the transfer), else empty."""

    request_id: str
    sender_id: int
    token: int
    logprob: bytes = b""


ControlMessage = Handshake | LayersReady | Grant | Abort | TransferError | FirstToken


class Envelope(msgspec.Struct, frozen=True):
    """A control message and where it goes: the owner delivers ``msg`` to that manager."""

    dst_role: Role
    dst_id: int
    msg: ControlMessage


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_notice_decoder = msgspec.msgpack.Decoder(PieceNotice)


def encode(envelope: Envelope) -> bytes:
    return _encoder.encode(envelope)


def decode(data: bytes) -> Envelope:
    return _envelope_decoder.decode(data)


def encode_notice(notice: PieceNotice) -> bytes:
    return _encoder.encode(notice)


def decode_notice(data: bytes) -> PieceNotice:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on malformed bytes."""
    return _notice_decoder.decode(data)
