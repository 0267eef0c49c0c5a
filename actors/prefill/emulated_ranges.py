"""EMULATION of elastic decode's hand-off: emulated prefill members stream token ranges.

The real body streams each token range of a prompt's KV straight to the decode instance that
will hold it (``range_stream.py``; LoongServe's proactive scale-down in P/D form). The emulated
body computes no KV, so here each member opens the same shards (one per range and receiver
that its zigzag share reaches, in range-local positions, through the same handshake protocol)
with zero KV of the wire geometry (``head_dim`` 1) and hands every layer to the send manager at
``(i + 1) · T / L`` of the profile's chunk time ``T``: the emulated backend times the paper's
bytes, and the receive side's coverage, grants and piece notices run for real. As with the real
body, the first token is not streamed with the KV (the master starts only once every holder
has its range: ``ElasticWorld.commit``).
"""

from __future__ import annotations

import time

import msgspec
import torch
from tetris.actors.decode.emulated import PLACEHOLDER_TOKEN, WIRE_HEAD_DIM, torch_dtype
from tetris.actors.prefill.executor import EmulatedExecutor, FaultInjected
from tetris.actors.prefill.messages import ChunkResult, ChunkTask
from tetris.actors.prefill.range_stream import check_ranges
from tetris.actors.prefill.zigzag import ranges_len

__all__ = ["EmulatedRangeExecutor", "open_emulated_range_shards"]


def open_emulated_range_shards(pump, model, tp_size: int,
                               task: ChunkTask) -> list[tuple[int, str, torch.Tensor]]:
    """Handshake one shard per (range, receiver) that this member's share reaches; returns
    (receiver, transfer id, zero KV ``[m, 2, h, WIRE_HEAD_DIM]`` sent at every layer)."""
    mine = task.chunk_positions[task.rank]
    dtype = torch_dtype(model.dtype)
    shards = []
    now = time.monotonic()
    with pump.locked() as mgr:
        for rng in task.kv_ranges:
            local = tuple((max(a, rng.start) - rng.start, min(b, rng.end) - rng.start)
                          for a, b in mine if max(a, rng.start) < min(b, rng.end))
            if not local:
                continue
            chunk = (max(task.chunk_start, rng.start) - rng.start,
                     min(task.chunk_end, rng.end) - rng.start)
            h = model.num_kv_heads // tp_size // len(rng.receivers)
            kv = torch.zeros((ranges_len(local), 2, h, WIRE_HEAD_DIM), dtype=dtype)
            for r in rng.receivers:
                mgr.add_shard(request_id=rng.transfer_id, chunk_index=task.chunk_index,
                              receiver_id=r, prompt_tokens=rng.end - rng.start, chunk=chunk,
                              ranges=local, num_layers=model.num_layers, kv_heads=h,
                              head_dim=WIRE_HEAD_DIM, dtype=dtype, now=now)
                shards.append((r, rng.transfer_id, kv))
    return shards


class EmulatedRangeExecutor(EmulatedExecutor):
    """``EmulatedExecutor`` that also takes chunks streaming by ``kv_ranges``."""

    def prepare(self, task: ChunkTask) -> None:
        if not task.kv_ranges:
            return super().prepare(task)
        if self.pump is None or self.model is None:
            raise RuntimeError(f"chunk {task.chunk_index} streams KV ranges but transfer is not "
                               f"enabled on emulated prefill instance {task.instance}")
        check_ranges(task, self.model.num_kv_heads // self.tp_size)
        # the holdings and the chunk checks as for any chunk: only the targets differ
        super().prepare(_without_targets(task))

    def execute(self, task: ChunkTask, link=None) -> ChunkResult:
        if not task.kv_ranges:
            return super().execute(task, link)
        t0 = self.clock()
        if self.fault is not None and self.fault[:2] == (task.request_id, task.chunk_index):
            self.fault = None
            raise FaultInjected("injected fault (emulated)")
        seconds = max(0.0, float(self.profile.predict(len(task.group), task.chunk_start,
                                                      task.chunk_end - task.chunk_start))
                      + (task.sp_layout_delta_s if task.sp_layout != "ring"
                         or task.sp_micro_partitions > 1 or task.sp_layout_delta_s else 0.0))
        shards = open_emulated_range_shards(self.pump, self.model, self.tp_size, task)
        layers = self.model.num_layers
        for i in range(layers):
            # absolute deadlines: the sleeps' overshoot does not add up over the layers
            self.sleep(max(0.0, t0 + seconds * (i + 1) / layers - self.clock()))
            with self.pump.locked() as mgr:
                for r, tid, kv in shards:
                    mgr.layer_ready(tid, task.chunk_index, i, kv, receiver_id=r)
        if task.balance != "off":
            self.holdings.release(task.request_id, [
                p for m in task.moves if m.src == task.instance for p in m.positions])
        last = task.prompt_tokens - 1
        holds_last = task.chunk_index == task.num_chunks - 1 and any(
            lo <= last < hi for lo, hi in task.chunk_positions[task.rank])
        return ChunkResult(
            request_id=task.request_id, chunk_index=task.chunk_index, instance=task.instance,
            rank=task.rank, elapsed_s=self.clock() - t0, emulated=True,
            first_token=PLACEHOLDER_TOKEN if holds_last else None, first_token_streamed=False)


def _without_targets(task: ChunkTask) -> ChunkTask:
    return msgspec.structs.replace(task, kv_ranges=())
