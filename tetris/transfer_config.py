"""The ``[transfer]`` table of a deployment: sizes and limits of KV streaming.

Part of the deployment configuration: ``tetris/config.py`` re-exports ``TransferConfig``, and
users load it through ``tetris.config``. A contract module: stdlib and msgspec only.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["TransferConfig"]


class TransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sizes and limits of KV streaming.

    ``num_backends`` receive backends (staging buffers of ``backend_buffer_bytes``) per decode
    instance; with at least ``pool_size`` of them every prefill instance gets its own
    (SPEC 7 step 3, first case), else requests are served in first-handshake order.
    ``policy = "per_chunk_fcfs"`` is the naive baseline that can starve (tests and ablations).
    ``backend = "emulated"`` (EMULATION, ``transfer/backends/emulated.py``) moves no payload: a
    write completes after ``wire bytes × emulated_bytes_per_wire_byte / emulated_link_bandwidth``
    and its notice then travels to the receiver; the other two fields serve only that backend.
    """

    num_backends: int = 4
    pool_size: int = 4
    backend_buffer_bytes: int = 4 << 20
    # Each backend's buffer is cut into this many slots, one credit (one piece in flight) each:
    # a sender holding several credits writes its next piece without waiting for a grant, so
    # streaming is not bound by one control round trip per piece.
    backend_slots: int = 4
    send_buffer_bytes: int = 4 << 20
    bulk_chunk_bytes: int = 1 << 20
    timeout_s: float = 30.0
    abort_grace_s: float = 1.0
    policy: Literal["handshake_order", "per_chunk_fcfs"] = "handshake_order"
    # "auto": NIXL over UCX when it starts, else in-process (same process only, with a warning)
    backend: Literal["auto", "nixl", "inproc", "emulated"] = "auto"
    # EMULATION: one sender's link at the paper's byte counts (one 200 Gb/s NIC per GPU, §7.1),
    # and how many paper bytes one wire byte stands for (emulated workers send head_dim 1).
    emulated_link_bandwidth: float = 25e9
    emulated_bytes_per_wire_byte: float = 128.0
    # A receiver remembers this many finished request ids (oldest forgotten first) to refuse
    # their late messages; a late message comes seconds after the end, thousands of requests
    # earlier than the oldest remembered one at any realistic rate.
    closed_memory: int = 16384
    # Write pieces straight into the decode rank's KV blocks (transfer/direct.py), no receive
    # staging; needs a backend with scattered writes (in-process, NIXL). Off by default: not
    # yet run on a GPU or in a served test (docs/transfer.md "Direct writes")
    direct_writes: bool = False

    def __post_init__(self) -> None:
        for key in ("num_backends", "pool_size", "backend_buffer_bytes", "backend_slots",
                    "send_buffer_bytes", "bulk_chunk_bytes", "closed_memory"):
            if getattr(self, key) <= 0:
                raise ValueError(f"transfer.{key} must be positive, got {getattr(self, key)}")
        if self.backend_slots > self.backend_buffer_bytes:
            raise ValueError(f"transfer.backend_slots ({self.backend_slots}) exceeds the "
                             f"{self.backend_buffer_bytes} bytes of a backend buffer")
        if self.emulated_link_bandwidth <= 0 or self.emulated_bytes_per_wire_byte <= 0:
            raise ValueError("transfer.emulated_link_bandwidth and emulated_bytes_per_wire_byte "
                             "must be positive")
        if self.timeout_s <= 0 or self.abort_grace_s < 0:
            raise ValueError("transfer.timeout_s must be positive and abort_grace_s non-negative")

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: the largest piece a grant allows."""
        return self.backend_buffer_bytes // self.backend_slots

    @property
    def dedicated_backends(self) -> bool:
        """Enough backends for one per prefill instance: no ordering needed."""
        return self.num_backends >= self.pool_size
