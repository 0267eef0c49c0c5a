"""A KunServe group of decode engines: drop into a pipeline, exchange KV, restore (§4.1-4.4).

Lifecycle of one group, in process:

1. ``drop(engines, ranges)``: checked whole first (ranges tile the layers, the running
   requests fit the group's blocks), then each member frees the layers outside its range and
   gets a KV cache for its own layers sized from its old KV bytes plus the freed parameter
   bytes; the group's capacity is the smallest member's (a request needs its blocks on every
   member). The *leader* (the first engine) takes every member's requests and runs them with
   a ``PipelineRunner``.
2. KV exchange: every request holding KV gets group blocks, and each member receives the KV
   of its layers from the request's home cache. Nothing is recomputed: ``num_computed`` stays.
3. ``restore()``: each member pulls its dropped layers back from the member that kept them,
   its full cache and block manager come back, and each request returns to its home (new
   ones to the member with most room) with the KV of every layer exchanged back.

The leader's scheduler, sampler and stop checks are ``LLMEngine``'s own, so tokens are those
of the single engine. This module reaches into the engine's batcher and block table state (it
is the engine package's own mechanism); the decode actors can wrap it per member later.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from tetris.engine.block_manager import BlockManager
from tetris.engine.engine import LLMEngine
from tetris.engine.kv_cache import KVCache, kv_bytes_per_block
from tetris.engine.model_runner import ModelRunner
from tetris.engine.pipeline import (
    PipelineRunner,
    Stage,
    StageCache,
    drop_layers,
    layer_bytes,
)
from tetris.engine.request import SequenceStatus
from tetris.sampling_params import SamplingParams

__all__ = ["PipelineGroup", "Resume", "drop", "layer_block_bytes", "lose_member"]


def layer_block_bytes(engine: LLMEngine) -> int:
    """K and V of one block of one layer in ``engine``'s cache."""
    m = engine.model
    return kv_bytes_per_block(1, engine.blocks.block_size, m.local_num_kv_heads, m.head_dim,
                              m.dtype)


def _check_ranges(ranges: list[tuple[int, int]], num_layers: int) -> None:
    expected = 0
    for start, end in ranges:
        if start != expected or end <= start:
            raise ValueError(f"layer ranges {ranges} do not tile [0, {num_layers}) in order: "
                             "a layer would lose its last copy in the group")
        expected = end
    if expected != num_layers:
        raise ValueError(f"layer ranges {ranges} leave layers [{expected}, {num_layers}) "
                         "without a copy in the group")


class PipelineGroup:
    """Members in pipeline order; ``leader`` serves all their requests until ``restore``."""

    def __init__(self, engines: list[LLMEngine], ranges: list[tuple[int, int]]) -> None:
        self.engines = list(engines)
        self.ranges = [tuple(r) for r in ranges]
        self.leader = engines[0]
        self._base_blocks = [e.blocks.num_blocks for e in engines]
        self.home: dict[str, int] = {}
        self.exchange_bytes = 0      # KV sent to a member other than the request's home
        self.pulled_param_bytes = 0  # restore
        self.freed_param_bytes = 0
        self.group_blocks = 0
        self.runner: PipelineRunner | None = None

    # -- 1. drop ---------------------------------------------------------------------------
    def member_blocks(self) -> list[int]:
        """Blocks each member can hold once dropped: (KV bytes + freed) // held layers' bytes."""
        out = []
        lbb = layer_block_bytes(self.leader)
        for engine, (start, end) in zip(self.engines, self.ranges, strict=True):
            model = engine.model
            freed = sum(layer_bytes(model.layers[i]) for i in range(model.num_layers)
                        if not start <= i < end)
            kv = engine.cache.buffer.numel() * engine.cache.buffer.element_size()
            out.append((kv + freed) // ((end - start) * lbb))
        return out

    def check_drop(self) -> None:
        """Everything ``drop`` needs, checked before anything changes (``ValueError``)."""
        if len(self.engines) < 2 or len({id(e.model) for e in self.engines}) != len(self.engines):
            raise ValueError("a group needs at least two engines, each with its own model copy")
        _check_ranges(self.ranges, self.leader.model.num_layers)
        for e in self.engines:
            if (e.cache is None or not isinstance(e.runner, ModelRunner)
                    or e.runner.graphs is not None):
                raise ValueError("only an undropped engine without CUDA graphs can join a group")
            if e.blocks.keeper is not None:   # kept runs' blocks, shared by reference
                raise ValueError("an engine keeping finished runs' KV (engine/kept_kv.py) "
                                 "cannot join a group")
            if any(s.status is SequenceStatus.RECEIVING for s in e._seqs.values()):
                raise ValueError("an engine is receiving a prefilled prompt's KV; drop after it")
        used = sum(e.blocks.num_blocks - e.blocks.num_free_blocks for e in self.engines)
        if used > min(self.member_blocks()):
            raise ValueError(f"running requests hold {used} blocks, the group {min(self.member_blocks())}")

    def drop(self) -> None:
        self.check_drop()
        self.group_blocks = min(self.member_blocks())
        bs = self.leader.blocks.block_size
        stages = []
        for j, (engine, (start, end)) in enumerate(zip(self.engines, self.ranges, strict=True)):
            m = engine.model
            cache = StageCache(start, end, self.group_blocks, bs, m.local_num_kv_heads,
                               m.head_dim, dtype=m.dtype, device=m.device)
            stages.append(Stage(j, m, cache))
        blocks = BlockManager(self.group_blocks, bs)
        for h, engine in enumerate(self.engines):
            for seq in engine._seqs.values():
                self.home[seq.request_id] = h
                if seq.block_table:
                    self._exchange_in(seq, engine.cache, blocks, stages, h)
        for j, (engine, (start, end)) in enumerate(zip(self.engines, self.ranges, strict=True)):
            self.freed_param_bytes += drop_layers(engine.model, start, end)
        self.runner = PipelineRunner(stages)
        self._merge_requests(blocks)

    def _exchange_in(self, seq, src: KVCache, blocks: BlockManager, stages: list[Stage],
                     home: int) -> None:
        """Drop: ``seq``'s KV from its engine's cache ``src`` to every stage's layers."""
        self._exchange(seq, blocks, src, stages, home, to_stages=True)

    def _exchange(self, seq, blocks: BlockManager, cache: KVCache, stages: list[Stage],
                  home: int, *, to_stages: bool) -> None:
        """Copy ``seq``'s KV between a whole-model ``cache`` and the stages' layer caches (to
        the stages, or back from them), into blocks newly reserved in ``blocks``; bytes that
        cross to another member than ``home`` count as exchanged."""
        old = torch.tensor(seq.block_table, dtype=torch.int64)
        seq.block_table = [blocks.reserve(seq.request_id) for _ in range(len(old))]
        new = torch.tensor(seq.block_table, dtype=torch.int64)
        for stage in stages:
            for layer in range(stage.start, stage.end):
                for staged, whole in ((stage.cache.k[layer], cache.k[layer]),
                                      (stage.cache.v[layer], cache.v[layer])):
                    dst, src = (staged, whole) if to_stages else (whole, staged)
                    dst[new] = src[old]
                    if stage.member != home:
                        self.exchange_bytes += src[old].numel() * src.element_size()

    def _merge_requests(self, blocks: BlockManager) -> None:
        leader = self.leader
        for e in self.engines:
            e.cache = None       # each member's KV now lives in its stage cache
        leader.blocks = leader.batcher.blocks = blocks
        leader.runner = self.runner
        leader._usable_blocks = self.group_blocks
        for f in self.engines[1:]:
            b = f.batcher
            leader.batcher.running.extend(b.running)
            leader.batcher.waiting.extend(b.waiting)
            leader.batcher.ready.extend(b.ready)
            b.running.clear(), b.waiting.clear(), b.ready.clear()
            leader._seqs.update(f._seqs)
            f._seqs.clear()
            leader._pending.extend(f._pending)
            f._pending.clear()

    # -- while dropped: prefill -> decode hand-off, layer-sliced ---------------------------
    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where layer ``layer``'s K and V go for a request reserved on the leader: the cache
        of the member that runs that layer ([NB, BS, Hkv, D] each; slots as ``reserve``
        returns them). A prefill streams each layer to its member only."""
        for stage in self.runner.stages:
            if stage.start <= layer < stage.end:
                return stage.cache.k[layer], stage.cache.v[layer]
        raise ValueError(f"layer {layer} is outside the model")

    # -- 3. restore ------------------------------------------------------------------------
    def _homes(self) -> dict[str, int]:
        """Each request's home; one admitted during the drop stays on the leader (the engine
        that admitted it) while it has room, else goes where most room is."""
        left = [n for n in self._base_blocks]
        homes = {}
        seqs = list(self.leader._seqs.values())
        for seq in seqs:
            if seq.request_id in self.home:
                homes[seq.request_id] = self.home[seq.request_id]
                left[homes[seq.request_id]] -= len(seq.block_table)
        for seq in seqs:
            if seq.request_id not in homes:
                h = 0 if left[0] >= len(seq.block_table) else \
                    max(range(len(left)), key=lambda i: (left[i], -i))
                homes[seq.request_id] = h
                left[h] -= len(seq.block_table)
        if min(left) < 0:
            raise ValueError(f"restore refused: requests need {[n - x for n, x in zip(self._base_blocks, left, strict=True)]} "
                             f"blocks on instances holding {self._base_blocks}")
        return homes

    def restore(self) -> None:
        homes = self._homes()    # refused before anything changes
        stages = self.runner.stages
        for j, engine in enumerate(self.engines):
            self._pull_layers(j)
            engine.cache = KVCache.for_model(engine.model, self._base_blocks[j],
                                             self.leader.blocks.block_size)
        new_blocks = [BlockManager(n, self.leader.blocks.block_size) for n in self._base_blocks]
        for seq in self.leader._seqs.values():
            if seq.block_table:
                h = homes[seq.request_id]
                self._exchange_out(seq, new_blocks[h], self.engines[h].cache, stages, h)
        self._split_requests(homes, new_blocks)
        self.runner = None

    def _pull_layers(self, j: int, skip: int | None = None) -> None:
        engine = self.engines[j]
        start = self.ranges[j][0]
        model = engine.model
        for k, (s, e) in enumerate(self.ranges):
            if k in (j, skip):
                continue
            src = self.engines[k].model
            for i in range(s, e):
                layer = type(src.layers[i])(model.cfg, model.tp_group, model.dtype, model.device)
                layer.load_state_dict(src.layers[i].state_dict())   # in place: fused views hold
                model.layers[i] = layer
                self.pulled_param_bytes += layer_bytes(layer)
        if model.layers[start].mlp.gate_up.packed is not None:   # packed like LLMEngine did
            model.pack_weights(batch_hint=engine.batcher.max_num_seqs)

    def _exchange_out(self, seq, blocks: BlockManager, dst: KVCache, stages: list[Stage],
                      home: int) -> None:
        """Restore: ``seq``'s KV from the stages back to its home engine's cache ``dst``."""
        self._exchange(seq, blocks, dst, stages, home, to_stages=False)

    def _split_requests(self, homes: dict[str, int], new_blocks: list[BlockManager]) -> None:
        leader = self.leader
        lb = leader.batcher
        queues = (list(lb.running), list(lb.waiting), list(lb.ready))
        seqs = dict(leader._seqs)
        lb.running.clear(), lb.waiting.clear(), lb.ready.clear()
        leader._seqs.clear()
        for j, engine in enumerate(self.engines):
            engine.blocks = engine.batcher.blocks = new_blocks[j]
            engine.runner = ModelRunner(engine.model, engine.cache, cuda_graphs=False)
            engine._usable_blocks = self._base_blocks[j]
            b = engine.batcher
            b.running.extend(s for s in queues[0] if homes[s.request_id] == j)
            b.waiting.extend(s for s in queues[1] if homes[s.request_id] == j)
            b.ready.extend(s for s in queues[2] if homes[s.request_id] == j)
            engine._seqs.update({r: s for r, s in seqs.items() if homes[r] == j})


class Resume(msgspec.Struct, frozen=True):
    """A request to run again on the resume path (``LLMEngine.reserve(..., generated)``)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    generated: tuple[int, ...]     # output tokens the client already has
    params: SamplingParams


def lose_member(group: PipelineGroup, dead: int,
                layer_source: Callable[[int], dict]) -> tuple[list[LLMEngine], list[Resume]]:
    """Member ``dead`` failed mid-pipeline (KunServe §4.4 fault tolerance).

    Its layers' KV is gone, so every request of the group leaves with the tokens it has
    streamed, for the resume path; each survivor becomes an undropped engine again, pulling
    the layers a survivor kept from it and the dead member's layers from ``layer_source``
    (layer -> state dict: a host-memory or checkpoint copy). Returns (survivors, resumes).
    """
    leader = group.leader
    resumes = []
    for rid, seq in list(leader._seqs.items()):
        n = len(seq.prompt_token_ids)
        resumes.append(Resume(rid, tuple(seq.prompt_token_ids), tuple(seq.tokens[n:]),
                              seq.params))
        leader.abort_request(rid)
    gone = {r.request_id for r in resumes}
    leader._pending = [o for o in leader._pending if o.request_id not in gone]
    start, end = group.ranges[dead]
    bs = leader.blocks.block_size
    survivors = []
    for j, e in enumerate(group.engines):
        if j == dead:
            continue
        for i in range(start, end):
            layer = _empty_layer(e.model)
            layer.load_state_dict(layer_source(i))
            e.model.layers[i] = layer
        group._pull_layers(j, skip=dead)
        e.cache = KVCache.for_model(e.model, group._base_blocks[j], bs)
        e.blocks = e.batcher.blocks = BlockManager(group._base_blocks[j], bs)
        e.runner = ModelRunner(e.model, e.cache, cuda_graphs=False)
        e._usable_blocks = group._base_blocks[j]
        survivors.append(e)
    group.runner = None
    return survivors, resumes


def _empty_layer(model):
    """A decoder layer shaped for ``model``, weights to be loaded (the class of its own)."""
    kept = next(layer for layer in model.layers if hasattr(layer, "self_attn"))
    return type(kept)(model.cfg, model.tp_group, model.dtype, model.device)


def drop(engines: list[LLMEngine], ranges: list[tuple[int, int]]) -> PipelineGroup:
    """Drop ``engines`` into one pipeline group; ``ValueError`` (nothing changed) if it cannot."""
    group = PipelineGroup(engines, ranges)
    group.drop()
    return group
