"""Transfer states and the events ``poll()`` returns (``TransferConfig`` is in
``tetris.config``).

Events stay inside a process (the manager's owner reads them); wire messages live in
``messages.py``.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = [
    "TransferState",
    "RequestReady",
    "ChunkArrived",
    "ShardSent",
    "TransferFailed",
    "MessageRejected",
    "ActivationGo",
    "FirstTokenIn",
    "TransferEvent",
]


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"   # sender: handshake out, no grant yet; receiver: reserved, no handshake
    WAITING = "waiting"               # waiting for a backend, a credit, or a layer to be computed
    TRANSFERRING = "transferring"     # a piece is on the wire / pieces are arriving
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class RequestReady(msgspec.Struct, frozen=True, tag=True):
    """Receiver: all layers of positions ``[0, prompt_tokens)`` have arrived; the blocks now
    belong to the owner (the decode engine), which adds the request at its next iteration."""

    request_id: str
    prompt_tokens: int
    block_table: list[int]


class ChunkArrived(msgspec.Struct, frozen=True, tag=True):
    """Receiver: every layer of every position of the chunk has arrived."""

    request_id: str
    chunk_index: int


class ShardSent(msgspec.Struct, frozen=True, tag=True):
    """Sender: every layer of this shard was written and acknowledged by the backend."""

    request_id: str
    chunk_index: int


class TransferFailed(msgspec.Struct, frozen=True, tag=True):
    """Either side: the request (receiver) or shard (sender) failed; all its resources are free."""

    request_id: str
    reason: str
    chunk_index: int | None = None


class MessageRejected(msgspec.Struct, frozen=True, tag=True):
    """Receiver: a handshake or piece was refused; nothing was written to the KV cache."""

    request_id: str
    sender_id: int
    reason: str


class ActivationGo(msgspec.Struct, frozen=True, tag=True):
    """Sender: the link is yours for activation ``tag``; call ``finish_activation`` after."""

    tag: str


class FirstTokenIn(msgspec.Struct, frozen=True, tag=True):
    """Receiver: the request's first token came with its KV (``messages.FirstToken``)."""

    request_id: str
    token: int
    logprob: bytes = b""


TransferEvent = (RequestReady | ChunkArrived | ShardSent | TransferFailed | MessageRejected
                 | ActivationGo | FirstTokenIn)
