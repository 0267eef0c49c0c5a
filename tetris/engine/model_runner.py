"""Runs one batch plan through the model with the paged KV cache.

The batch is flat ("varlen"): decode tokens first (one per sequence), then each prefill
chunk's tokens. Per layer the attention op first writes the new K/V into their cache slots,
then:

- decode rows attend through ``paged_decode_attention`` over their block tables;
- a prefill chunk with no cached prefix runs plain causal attention on its own K/V;
- a chunk continuing a cached prefix (chunked prefill, recompute) reads prefix and chunk K/V
  back from the cache and masks by absolute position.

Decode-only iterations go through ``decode_step``, which is graph-safe on CUDA (no host
reads of device values). With CUDA graphs on, a batch that fits a captured size runs by replay, padded
to that size: padding rows have context length 0 (they attend to nothing) and write their
K/V to a scratch slot no sequence owns. Mixed prefill/decode batches, and batches larger than
every captured size, run eagerly. Off CUDA, ``cuda_graphs=True`` runs the same padded path
eagerly (``DecodeGraphRunner``'s emulation), which is how the dispatch is tested on CPU.
"""

from __future__ import annotations

import os

import msgspec
import torch

from tetris.engine.batcher import BatchPlan
from tetris.engine.cuda_graphs import DecodeGraphRunner, StaticInput, default_batch_buckets
from tetris.engine.kv_cache import KVCache
from tetris.engine.logprobs import record_prompt_logprobs
from tetris.engine.request import Sequence
from tetris.kernels import dispatch
from tetris.kernels.paged_decode import decode_meta, paged_decode_attention_meta, write_kv

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


def _torch_decode_path(device: torch.device) -> bool:
    """Whether ``dispatch.paged_decode_attention`` would take the torch path here: off CUDA
    unless the Triton interpreter is asked for (see tetris.kernels.dispatch)."""
    if device.type == "cuda":
        return False
    return not (os.environ.get("TRITON_INTERPRET") == "1"
                and os.environ.get("TETRIS_KERNEL_BACKEND") == "triton")


class ModelRunner:
    """Executes batch plans; ``cuda_graphs`` (None: on iff the cache is on CUDA) needs
    ``scratch_slot``, a cache slot that no sequence owns, and ``max_blocks_per_seq``, the
    block-table width the graphs are captured with (the longest sequence's blocks)."""

    def __init__(self, model, cache: KVCache, *, cuda_graphs: bool | None = None,
                 graph_batch_sizes: list[int] | None = None, scratch_slot: int | None = None,
                 max_blocks_per_seq: int | None = None, max_batch_size: int = 32) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.device = cache.buffer.device
        self.graph_steps = 0  # decode steps run through the graph runner (replay or emulation)
        self.eager_steps = 0
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        self.graphs: DecodeGraphRunner | None = None
        if cuda_graphs:
            if scratch_slot is None or max_blocks_per_seq is None:
                raise ValueError("CUDA graphs need a scratch_slot and max_blocks_per_seq")
            sizes = graph_batch_sizes or default_batch_buckets(max_batch_size)
            self.graphs = self._graph_runner(sizes, scratch_slot, max_blocks_per_seq)
            self._graph_width = max_blocks_per_seq
        # Elastic decode (engine/elastic_rows.py): merges the decode rows' remote partials and
        # answers other masters' queries between this engine's layers; None: off.
        self.elastic = None

    def _graph_runner(self, sizes: list[int], scratch_slot: int,
                      max_blocks: int) -> DecodeGraphRunner:
        if not 0 <= scratch_slot < self.cache.num_blocks * self.block_size:
            raise ValueError(f"scratch_slot {scratch_slot} is outside the cache")
        inputs = [
            StaticInput("input_ids", (), "int64"),
            StaticInput("positions", (), "int64"),
            StaticInput("slot_mapping", (), "int64", pad_value=scratch_slot),
            StaticInput("block_tables", (max_blocks,), "int32"),
            StaticInput("context_lens", (), "int32"),  # 0: padding rows attend to nothing
        ]
        # Off CUDA the runner emulates (padded static buffers, eager): same dispatch, testable.
        return DecodeGraphRunner(self.decode_step, inputs, sizes, self.device, emulate=True)

    def prepare(self, plan: BatchPlan) -> BatchInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        lens: list[int] = []
        for sched in plan.decodes:
            seq = sched.seq
            pos = seq.num_computed
            local = pos - seq.kv_start  # a sharded request's master holds [kv_start, pos]
            ids.append(seq.tokens[pos])
            positions.append(pos)
            slots.append(seq.block_table[local // bs] * bs + local % bs)
            lens.append(local + 1)
            sample_rows.append(len(ids) - 1)
            sample_seqs.append(seq)
        num_decodes = len(plan.decodes)
        max_blocks = max((len(s.seq.block_table) for s in plan.decodes), default=0)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table))
                  for s in plan.decodes]
        block_tables = torch.tensor(tables, dtype=torch.int32).reshape(num_decodes, max_blocks)
        context_lens = torch.tensor(lens, dtype=torch.int32)
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
        """Run ``plan``; return logits [N, V] of the sequences that sample, in order. Prefill
        chunks of requests that asked for prompt logprobs record them on their sequence.

        The logits are float32, except when every sampling sequence is greedy: then they stay
        in the model's dtype, whose argmax is the fp32 one (a [32, 32000] bf16 -> fp32 copy
        was 5% of a bf16 decode step on CPU; docs/benchmarks.md).
        """
        inputs = self.prepare(plan)
        if self.elastic is not None:
            self.elastic.begin(inputs.sample_seqs[:inputs.num_decodes])
        upcast = not all(seq.params.greedy for seq in inputs.sample_seqs)
        if not inputs.prefills:  # decode only: every row samples, in plan order
            logits = self._decode(inputs)
            return (logits.float() if upcast else logits), inputs.sample_seqs

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return self.attention(layer, q, k, v, inputs)

        hidden = self.model.forward(inputs.input_ids, inputs.positions, attention)
        for sched, span in zip(plan.prefills, inputs.prefills):
            if sched.seq.prompt_logprobs is not None:   # asked for: a projection per position
                record_prompt_logprobs(self.model, hidden, span.row, span.start, span.n,
                                       sched.seq)
        if not inputs.sample_seqs:
            return hidden.new_empty(0, 0, dtype=torch.float32), []
        rows = hidden.index_select(0, inputs.sample_rows)
        return self.model.logits(rows, upcast=upcast), inputs.sample_seqs

    def _decode(self, inputs: BatchInputs) -> torch.Tensor:
        tensors = dict(input_ids=inputs.input_ids, positions=inputs.positions,
                       slot_mapping=inputs.slot_mapping, block_tables=inputs.block_tables,
                       context_lens=inputs.context_lens)
        graphs = self.graphs
        eager = graphs is None or self.elastic is not None  # no exchange inside a graph
        if eager or graphs.bucket_for(inputs.num_decodes) is None:
            self.eager_steps += 1
            return self.decode_step(**tensors)
        self.graph_steps += 1
        width = self._graph_width
        tables = inputs.block_tables
        if tables.shape[1] > width:
            raise ValueError(f"a block table has {tables.shape[1]} blocks; graphs hold {width}")
        tensors["block_tables"] = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
        return graphs.run(**tensors)

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor) -> torch.Tensor:
        """One token per sequence -> logits [B, V] in the model's dtype (``execute`` widens).

        Graph-safe on CUDA (no host reads there); the CPU torch path reads the longest
        context length once per step to size its gather.

        input_ids, positions, slot_mapping int64 [B]; block_tables int32 [B, MAXB];
        context_lens int32 [B] (positions + 1 for live rows).
        """
        meta = None
        if _torch_decode_path(self.device) and self.elastic is None:
            # The torch kernel's per-step tensors (tables, mask), built once, not per layer.
            meta = decode_meta(block_tables, context_lens, self.block_size,
                               self.cache.num_blocks, int(context_lens.max()))

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
            # Slots come from our own block tables (in range by construction).
            write_kv(k_cache, v_cache, k, v, slot_mapping, check_bounds=False)
            if self.elastic is not None:
                return self.elastic.decode_attention(layer, q, k_cache, v_cache, block_tables,
                                                     context_lens)
            if meta is not None:
                return paged_decode_attention_meta(q, k_cache, v_cache, meta)
            return dispatch.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                   context_lens)

        return self.model.logits(self.model.forward(input_ids, positions, attention),
                                 upcast=False)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  inputs: BatchInputs) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of a batch with prefill rows -> out [T, Hq, D]."""
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        write_kv(k_cache, v_cache, k, v, inputs.slot_mapping, check_bounds=False)
        nd = inputs.num_decodes
        out = torch.empty_like(q)
        if self.elastic is not None:  # every layer: it may answer other masters' queries
            out[:nd] = self.elastic.decode_attention(layer, q[:nd], k_cache, v_cache,
                                                     inputs.block_tables, inputs.context_lens)
        elif nd:
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
