"""Runs one batch plan through the model with the paged KV cache.

The batch is flat ("varlen"): decode tokens first (one per sequence), then each prefill
chunk's tokens. Per layer the attention op first writes the new K/V into their cache slots,
then:

- decode rows attend through ``paged_decode_attention`` over their block tables;
- a prefill chunk with no cached prefix runs plain causal attention on its own K/V;
- a chunk continuing a cached prefix (chunked prefill, recompute) reads prefix and chunk K/V
  back from the cache and masks by absolute position.
"""

from __future__ import annotations

import msgspec
import torch

from tetris.engine.batcher import BatchPlan
from tetris.engine.kv_cache import KVCache
from tetris.engine.request import Sequence
from tetris.kernels import dispatch
from tetris.kernels.paged_decode import write_kv

__all__ = ["ModelRunner", "BatchInputs"]


class _PrefillSpan(msgspec.Struct):
    """Rows [row, row + n) of the batch: a chunk at positions [start, start + n) of a sequence."""

    row: int
    n: int
    start: int
    slots: torch.Tensor  # int64 [start + n]: slots of all positions up to the chunk's end


class BatchInputs(msgspec.Struct):
    input_ids: torch.Tensor      # int64 [T]
    positions: torch.Tensor      # int64 [T]
    slot_mapping: torch.Tensor   # int64 [T]
    num_decodes: int
    block_tables: torch.Tensor   # int32 [num_decodes, MAXB]
    context_lens: torch.Tensor   # int32 [num_decodes]
    prefills: list[_PrefillSpan]
    sample_rows: torch.Tensor    # int64 [N]: row of each sampling sequence's last token
    sample_seqs: list[Sequence]


class ModelRunner:
    def __init__(self, model, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.device = cache.buffer.device

    def prepare(self, plan: BatchPlan) -> BatchInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for sched in plan.decodes:
            seq = sched.seq
            pos = seq.num_computed
            ids.append(seq.tokens[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            sample_rows.append(len(ids) - 1)
            sample_seqs.append(seq)
        num_decodes = len(plan.decodes)
        max_blocks = max((len(s.seq.block_table) for s in plan.decodes), default=0)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table))
                  for s in plan.decodes]
        block_tables = torch.tensor(tables, dtype=torch.int32).reshape(num_decodes, max_blocks)
        context_lens = torch.tensor(positions, dtype=torch.int32) + 1
        prefills = []
        for sched in plan.prefills:
            span = self._prefill_span(sched.seq, sched.num_new_tokens, len(ids))
            prefills.append(span)
            ids.extend(sched.seq.tokens[span.start:span.start + span.n])
            positions.extend(range(span.start, span.start + span.n))
            slots.extend(span.slots[span.start:].tolist())
            if sched.samples:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(sched.seq)
        dev = self.device
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decodes=num_decodes,
            block_tables=block_tables.to(dev),
            context_lens=context_lens.to(dev),
            prefills=prefills,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            sample_seqs=sample_seqs,
        )

    def _prefill_span(self, seq: Sequence, n: int, row: int) -> _PrefillSpan:
        start = seq.num_computed
        pos = torch.arange(start + n, dtype=torch.int64)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        slots = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return _PrefillSpan(row=row, n=n, start=start, slots=slots.to(self.device))

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> tuple[torch.Tensor, list[Sequence]]:
        """Run ``plan``; return logits [N, V] float32 of the sequences that sample, in order."""
        inputs = self.prepare(plan)

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return self.attention(layer, q, k, v, inputs)

        hidden = self.model.forward(inputs.input_ids, inputs.positions, attention)
        if not inputs.sample_seqs:
            return hidden.new_empty(0, 0, dtype=torch.float32), []
        return self.model.logits(hidden.index_select(0, inputs.sample_rows)), inputs.sample_seqs

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  inputs: BatchInputs) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the whole flat batch -> out [T, Hq, D]."""
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        write_kv(k_cache, v_cache, k, v, inputs.slot_mapping)
        nd = inputs.num_decodes
        if nd and not inputs.prefills:
            return dispatch.paged_decode_attention(q, k_cache, v_cache, inputs.block_tables,
                                                   inputs.context_lens)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = dispatch.paged_decode_attention(q[:nd], k_cache, v_cache,
                                                       inputs.block_tables, inputs.context_lens)
        for span in inputs.prefills:
            rows = slice(span.row, span.row + span.n)
            if span.start == 0:
                out[rows] = dispatch.attention_with_lse(q[rows], k[rows], v[rows], causal=True)[0]
                continue
            k_all, v_all = self.cache.gather(layer, span.slots)
            q_pos = torch.arange(span.start, span.start + span.n, device=q.device)
            k_pos = torch.arange(span.start + span.n, device=q.device)
            out[rows] = dispatch.attention_with_lse(q[rows], k_all, v_all, causal=True,
                                                    q_positions=q_pos, k_positions=k_pos)[0]
        return out
