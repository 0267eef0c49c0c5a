"""KV cache transfer from the prefill group to a decode instance (SPEC §7), as time.

Each member of a chunk's group sends its shard of the chunk's KV over its own NIC, layer by
layer as layers finish (the transfer overlaps compute). The receiving decode instance's NICs
bound the aggregate rate and are shared by all requests it receives (FIFO link). Per chunk with
``L`` layers, compute time ``c`` per layer and transfer time ``x`` per layer::

    done = max(chunk_end + x,            # the last layer's share lands after the chunk ends
               chunk_start + c + L*x,    # transfer-bound: layers queue behind the link
               link_free + L*x)          # the receive link is still busy with earlier KV

A request's KV is ready when its last chunk's transfer is done.
"""

from __future__ import annotations

import msgspec

from tetris.sim.prefill import ChunkRun

__all__ = ["KVTransferModel"]


class KVTransferModel(msgspec.Struct, frozen=True):
    bytes_per_token: int        # all layers, K and V
    num_layers: int
    send_bandwidth: float       # bytes/s of one prefill instance's NIC(s)
    recv_bandwidth: float       # bytes/s into one decode instance

    def __post_init__(self) -> None:
        if min(self.bytes_per_token, self.num_layers) <= 0 or min(self.send_bandwidth,
                                                                   self.recv_bandwidth) <= 0:
            raise ValueError("KV transfer sizes and bandwidths must be positive")

    def chunk_seconds(self, tokens: int, sp: int) -> float:
        """Pure transfer time of one chunk's KV (no overlap)."""
        rate = min(sp * self.send_bandwidth, self.recv_bandwidth)
        return tokens * self.bytes_per_token / rate

    def ready_time(self, runs: list[ChunkRun], link_free: float) -> float:
        """When all of a request's KV has arrived; ``link_free`` is the receive link's free time."""
        L = self.num_layers
        done = link_free
        for r in runs:
            x = self.chunk_seconds(r.tokens, len(r.instances)) / L
            c = (r.end - r.start) / L
            done = max(r.end + x, r.start + c + L * x, done + L * x)
        return done
