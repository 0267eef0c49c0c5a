"""Elastic decode's hand-off from the prefill side: each token range of a prompt's KV streamed
straight to the decode instance that will hold it (issue #25; LoongServe's proactive
scale-down, loongserve-notes §1.3, in P/D form: no second migration step).

A chunk's task lists ``KVRange``s (messages.py): positions ``[start, end)`` go to
``receivers`` (one decode instance's TP ranks, receiver j taking KV heads ``[j*h, (j+1)*h)``,
as ``kv_receivers``) as transfer ``transfer_id``, in range-local positions ``p - start``:
the decode side reserved exactly that (``Reserve(kv_start)`` for the master's range under the
request id, ``Hold`` as ``<id>@<start>``; actors/decode/elastic.py). Each member streams the
part of its zigzag share inside each range, one shard per (range, receiver) and chunk, through
the existing handshake protocol. The first token is not sent with the KV: the master may
start only once every holder has its range (``ElasticWorld.commit``).
"""

from __future__ import annotations

import time

import torch
from tetris.actors.prefill.kv_store import ranges_tensor
from tetris.actors.prefill.messages import ChunkTask

__all__ = ["check_ranges", "open_range_shards", "stream_range_layer"]


def check_ranges(task: ChunkTask, kv_heads: int) -> None:
    """The ranges tile ``[0, prompt)`` in order and each one's receivers split the heads."""
    ends = [0] + [r.end for r in task.kv_ranges]
    if [r.start for r in task.kv_ranges] != ends[:-1] or ends[-1] != task.prompt_tokens \
            or any(r.end <= r.start for r in task.kv_ranges):
        raise ValueError(f"KV ranges {[(r.start, r.end) for r in task.kv_ranges]} do not tile "
                         f"[0, {task.prompt_tokens}) in order")
    for r in task.kv_ranges:
        n = len(r.receivers)
        if n == 0 or kv_heads % n or len(set(r.receivers)) != n:
            raise ValueError(f"{kv_heads} KV heads cannot be split over receivers {r.receivers}")
    if task.kv_receivers:
        raise ValueError("a chunk streams either to kv_receivers or by kv_ranges, not both")


def open_range_shards(pump, model, task: ChunkTask) -> list[tuple[int, slice, str, torch.Tensor]]:
    """Handshake one shard per (range, receiver) that this member's share reaches; returns
    (receiver, head slice, transfer id, rows of this member's k/v) per shard."""
    mine = task.chunk_positions[task.rank]
    pos = ranges_tensor(mine)
    targets = []
    now = time.monotonic()
    with pump.locked() as mgr:
        for rng in task.kv_ranges:
            local = [(max(a, rng.start) - rng.start, min(b, rng.end) - rng.start)
                     for a, b in mine if max(a, rng.start) < min(b, rng.end)]
            if not local:
                continue
            rows = ((pos >= rng.start) & (pos < rng.end)).nonzero().flatten()
            chunk = (max(task.chunk_start, rng.start) - rng.start,
                     min(task.chunk_end, rng.end) - rng.start)
            h = model.local_num_kv_heads // len(rng.receivers)
            for j, r in enumerate(rng.receivers):
                mgr.add_shard(request_id=rng.transfer_id, chunk_index=task.chunk_index,
                              receiver_id=r, prompt_tokens=rng.end - rng.start, chunk=chunk,
                              ranges=local, num_layers=model.num_layers, kv_heads=h,
                              head_dim=model.head_dim, dtype=model.dtype, now=now)
                targets.append((r, slice(j * h, (j + 1) * h), rng.transfer_id, rows))
    return targets


def stream_range_layer(pump, task: ChunkTask, layer: int, k, v, targets) -> None:
    """k, v [n, Hkv, D] of this member's share -> each shard its rows and heads [m, 2, h, D]."""
    parts = [(r, tid, torch.stack((k[rows][:, hs], v[rows][:, hs]), dim=1))
             for r, hs, tid, rows in targets]
    with pump.locked() as mgr:
        for r, tid, kv in parts:
            mgr.layer_ready(tid, task.chunk_index, layer, kv, receiver_id=r)
