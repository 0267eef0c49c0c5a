"""What a receive manager refuses: the checks on a handshake and on a piece's notice.

A bad handshake or piece is rejected and writes nothing (``protocol.py``, Errors): the
``ReceiveManager`` (``receive_manager.py``) asks ``check_handshake`` / ``check_piece`` for the
reason before it claims positions or places bytes, and sends it back in a ``TransferError``.
The checks read the manager's state and change nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tetris.transfer.messages import Handshake, PieceNotice
from tetris.transfer.protocol import IncomingShard

if TYPE_CHECKING:
    from tetris.transfer.receive_manager import ReceiveManager

__all__ = ["check_handshake", "check_piece", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_handshake(mgr: ReceiveManager, hs: Handshake) -> str | None:
    """Why ``mgr`` refuses the handshake ``hs``, or None to accept it."""
    if hs.receiver_id != mgr.receiver_id:
        return f"handshake for decode instance {hs.receiver_id} reached {mgr.receiver_id}"
    if mgr.config.dedicated_backends and not 0 <= hs.sender_id < mgr.config.pool_size:
        # backend i serves prefill instance i: any other sender would never get a grant
        return (f"sender {hs.sender_id} is outside the prefill pool of {mgr.config.pool_size} "
                f"instances that this receiver's dedicated backends serve")
    want = (mgr.num_layers, mgr.kv_heads, mgr.head_dim, dtype_name(mgr.dtype))
    got = (hs.num_layers, hs.kv_heads, hs.head_dim, hs.dtype)
    if got != want:
        return f"KV shape (layers, kv_heads, head_dim, dtype) {got} differs from this cache's {want}"
    if hs.request_id in mgr._closed:
        return f"request already {mgr._closed[hs.request_id]}"
    if hs.prompt_tokens <= 0:
        return "prompt_tokens must be positive"
    return None


def check_piece(mgr: ReceiveManager, peer: str, n: PieceNotice
                ) -> tuple[str | None, IncomingShard | None]:
    """Why ``mgr`` refuses the piece of notice ``n`` from agent ``peer`` (or None), and the
    shard it was granted to when there is one (its credit was spent on the piece)."""
    if not 0 <= n.backend_id < len(mgr.backends) or not 0 <= n.slot < mgr.config.backend_slots:
        return f"no receive backend {n.backend_id} slot {n.slot}", None
    req = mgr.requests.get(n.request_id)
    if req is None:
        return "unknown request", None
    shard = req.shards.get((n.sender_id, n.chunk_index))
    if shard is None:
        return f"no handshake for chunk {n.chunk_index} from sender {n.sender_id}", None
    if mgr._sender_agents.get(n.sender_id) != peer:
        return f"piece from agent {peer!r}, sender {n.sender_id} handshook as another agent", None
    if mgr.backends[n.backend_id].credits.get(n.slot) != (n.request_id, shard.key):
        return f"backend {n.backend_id} slot {n.slot} was not granted to this shard", None
    if n.dtype != dtype_name(mgr.dtype):
        return f"dtype {n.dtype} differs from the cache's {dtype_name(mgr.dtype)}", shard
    if not (0 <= n.layer < mgr.num_layers and n.num_tokens > 0 and n.token_offset >= 0
            and n.token_offset + n.num_tokens <= shard.positions.size):
        return f"layer {n.layer} tokens [{n.token_offset}, +{n.num_tokens}) outside the shard", shard
    if n.nbytes != n.num_tokens * mgr.bytes_per_token or n.nbytes > mgr.config.slot_bytes:
        return f"{n.nbytes} bytes for {n.num_tokens} tokens (want {n.num_tokens * mgr.bytes_per_token})", shard
    if shard.received[n.layer, n.token_offset:n.token_offset + n.num_tokens].any():
        return f"duplicate piece: layer {n.layer} tokens from {n.token_offset} already arrived", shard
    return None, shard
