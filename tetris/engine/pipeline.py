"""KunServe's cooperative execution (§4.2): one batch plan run as a pipeline of stages.

After a drop, each member of a group keeps a contiguous range of the decoder layers of its own
copy of the model, and a KV cache for those layers only. A step runs the batch through the
members in order: member k runs its layers and hands the hidden states [T, H] (the
*activation*) to member k + 1; the last member applies the final norm and samples. Every
member's cache is indexed by the same block ids (the group's block manager), so one block
table serves all of them.

``PipelineRunner.execute`` has ``ModelRunner.execute``'s contract, so ``LLMEngine`` schedules,
samples and stops exactly as with one instance; per layer, the same kernels run on the same
shapes as ``ModelRunner`` (paged decode for decode-only steps, the mixed path otherwise), which
is why tokens are bit-identical to the single engine's.

In process the hop is a copy, or ``hop`` (e.g. ``tetris.transfer.activation_hop.LinkHop``:
over a socket, ahead of bulk KV on the same link); counters (``activation_hops``,
``activation_bytes``) say what a network would carry. ``prefill_tokens`` counts prompt tokens computed, the proof that a drop
recomputes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tetris.engine.batcher import BatchPlan
from tetris.engine.logprobs import record_prompt_logprobs
from tetris.engine.model_runner import BatchInputs, ModelRunner, _torch_decode_path
from tetris.kernels import dispatch
from tetris.kernels.paged_decode import (
    decode_meta,
    paged_decode_attention_meta,
    write_kv,
)

__all__ = ["PipelineRunner", "Stage", "StageCache", "drop_layers", "layer_bytes"]


class StageCache:
    """The paged KV of layers ``[start, end)`` over ``num_blocks`` blocks.

    Duck-types ``KVCache`` for ``ModelRunner.attention``: ``k``/``v`` are indexed by the global
    layer id. buffer [end - start, 2, NB, BS, Hkv, D].
    """

    def __init__(self, start: int, end: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        if not 0 <= start < end or num_blocks <= 0:
            raise ValueError(f"a stage needs layers [start, end) and blocks, got "
                             f"[{start}, {end}) and {num_blocks}")
        self.start, self.end = start, end
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.buffer = torch.zeros(end - start, 2, num_blocks, block_size, num_kv_heads,
                                  head_dim, dtype=dtype, device=device)
        self.k = {layer: self.buffer[layer - start, 0] for layer in range(start, end)}
        self.v = {layer: self.buffer[layer - start, 1] for layer in range(start, end)}

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k[layer].view(-1, *self.k[layer].shape[2:])
        v = self.v[layer].view(-1, *self.v[layer].shape[2:])
        return k.index_select(0, slots), v.index_select(0, slots)


def drop_layers(model, start: int, end: int) -> int:
    """Free the decoder layers of ``model`` outside ``[start, end)``; returns the bytes freed.

    A dropped layer becomes an empty module, so any use of it fails loudly.
    """
    freed = 0
    for i in range(model.num_layers):
        if start <= i < end or not _holds(model, i):
            continue
        freed += layer_bytes(model.layers[i])
        model.layers[i] = torch.nn.Module()
    return freed


def _holds(model, layer: int) -> bool:
    return hasattr(model.layers[layer], "self_attn")


def layer_bytes(layer: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


class Stage:
    """One member of a group: its model copy (layers ``[start, end)`` kept) and their KV."""

    def __init__(self, member: int, model, cache: StageCache) -> None:
        self.member = member
        self.model = model
        self.cache = cache
        self.start, self.end = cache.start, cache.end
        for i in range(self.start, self.end):
            if not _holds(model, i):
                raise ValueError(f"member {member} runs layer {i} but does not hold it")
        # Only its mixed-batch attention is used (``prepare`` and ``attention``).
        self.runner = ModelRunner(model, cache, cuda_graphs=False)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, inputs: BatchInputs,
            decode_only: bool, meta) -> torch.Tensor:
        """hidden [T, H] before layer ``start`` -> hidden [T, H] after layer ``end - 1``."""
        model = self.model
        cos_sin = model.rotary.cos_sin(positions, hidden.dtype)
        for i in range(self.start, self.end):
            q, k, v = model._qkv(i, hidden, cos_sin)
            if not decode_only:
                attn = self.runner.attention(i, q, k, v, inputs)
            else:   # decode-only: ModelRunner.decode_step's op
                k_cache, v_cache = self.cache.k[i], self.cache.v[i]
                write_kv(k_cache, v_cache, k, v, inputs.slot_mapping, check_bounds=False)
                attn = (paged_decode_attention_meta(q, k_cache, v_cache, meta) if meta is not None
                        else dispatch.paged_decode_attention(q, k_cache, v_cache,
                                                             inputs.block_tables,
                                                             inputs.context_lens))
            hidden = model.layer_attn_out(i, hidden, attn)
            hidden = model.layer_mlp(i, hidden)
        return hidden


class PipelineRunner:
    """Runs batch plans through ``stages`` (ordered, their layer ranges tiling the model)."""

    def __init__(self, stages: list[Stage]) -> None:
        expected = 0
        for stage in stages:
            if stage.start != expected:
                raise ValueError(f"stage of member {stage.member} starts at layer {stage.start},"
                                 f" expected {expected}")
            expected = stage.end
        if expected != stages[0].model.num_layers:
            raise ValueError(f"stages end at layer {expected} of {stages[0].model.num_layers}")
        self.stages = stages
        self.block_size = stages[0].cache.block_size
        self.activation_hops = 0
        self.activation_bytes = 0
        self.prefill_tokens = 0
        self.steps = 0
        # The hop to the next member: a copy in process, or a link (transfer/activation_hop.py)
        self.hop: Callable[[torch.Tensor], torch.Tensor] | None = None

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> tuple[torch.Tensor, list]:
        """``ModelRunner.execute`` over the pipeline: logits [N, V] of the sampling sequences."""
        first, last = self.stages[0], self.stages[-1]
        inputs = first.runner.prepare(plan)
        self.steps += 1
        self.prefill_tokens += sum(s.num_new_tokens for s in plan.prefills)
        upcast = not all(seq.params.greedy for seq in inputs.sample_seqs)
        decode_only = not inputs.prefills
        meta = None   # the torch decode kernel's per-step tensors, built once as ModelRunner does
        if decode_only and _torch_decode_path(first.cache.buffer.device):
            meta = decode_meta(inputs.block_tables, inputs.context_lens, self.block_size,
                               first.cache.num_blocks, int(inputs.context_lens.max()))
        positions = inputs.positions.to(first.model.device)
        hidden = first.model.embed(inputs.input_ids)
        hidden = self.run_stages(hidden, positions, inputs, decode_only, meta)
        hidden = last.model.final_norm(hidden)
        if decode_only:
            logits = last.model.logits(hidden, upcast=False)
            return (logits.float() if upcast else logits), inputs.sample_seqs
        for sched, span in zip(plan.prefills, inputs.prefills):
            if sched.seq.prompt_logprobs is not None:
                record_prompt_logprobs(last.model, hidden, span.row, span.start, span.n,
                                       sched.seq)
        if not inputs.sample_seqs:
            return hidden.new_empty(0, 0, dtype=torch.float32), []
        rows = hidden.index_select(0, inputs.sample_rows)
        return last.model.logits(rows, upcast=upcast), inputs.sample_seqs

    def run_stages(self, hidden: torch.Tensor, positions: torch.Tensor, inputs: BatchInputs,
                   decode_only: bool, meta) -> torch.Tensor:
        """hidden [T, H] after the embedding -> after the last layer, stage after stage (a
        served member overrides it: ``actors/decode/stage_chain.py``)."""
        for k, stage in enumerate(self.stages):
            if k:
                hidden = self._hand_off(hidden)
            hidden = stage.run(hidden, positions, inputs, decode_only, meta)
        return hidden

    def _hand_off(self, hidden: torch.Tensor) -> torch.Tensor:
        """The activation hop to the next member (``hop``, else a copy in process)."""
        self.activation_hops += 1
        self.activation_bytes += hidden.numel() * hidden.element_size()
        return hidden.clone() if self.hop is None else self.hop(hidden)
