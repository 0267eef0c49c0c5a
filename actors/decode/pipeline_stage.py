"""A served decode rank as one member of a KunServe group (issue #24, §4.1-4.4).

After a drop, member j of a group keeps decoder layers ``ranges[j]`` of its own model copy
and a ``StageCache`` of those layers over the group's ``group_blocks`` blocks. The block ids
are the group's: member j's engine allocates only from its *part* ``parts[j]`` (every other
part is withheld in its block manager), so a request's blocks mean the same slots on every
member and no id is ever translated. Each member keeps its own requests, scheduler, sampler
and stop checks; its engine's runner is a ``PipelineRunner`` over the group's stages, its own
layers run here (``Stage``), the others on their members (``RemoteStage``): the hidden states
go there as an activation message through the pair's priority link (``group_links.py``),
the member runs its layers on them (the *stage server*, on the link's reader thread) and
sends them back. With every member driving its own batch, the group has one micro-batch in
flight per member, which is what keeps a KunServe pipeline's stages busy.

Lifecycle, driven by ``actors/decode/kunserve_group.py`` with every member's rounds paused:

1. ``GroupMember(engine, j, host)`` listens; ``connect`` joins the pair links.
2. ``drop(ranges, group_blocks, parts)``: the member's requests get blocks of its part; its
   own layers' KV is copied over locally and every other member's layers' KV is sent to it
   as bulk over the link (KV exchange: nothing is recomputed); it waits for the other
   members' KV of its layers, frees the layers it does not keep and switches the engine.
3. ``restore(base_blocks)``: the layers it dropped come back from their keepers (bulk), its
   requests get blocks of a whole-model cache again and each keeper sends back the KV of its
   layers for them; then ``close``.

A peer whose link breaks (the member died) fails the step waiting for it, so the instance
breaks and its requests take the dispatcher's resume path.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import msgspec
import torch
from tetris.actors.decode.group_links import GroupLinks
from tetris.kernels.paged_decode import decode_meta
from tetris.transfer.traffic import TrafficClass

from tetris.engine.block_manager import BlockManager
from tetris.engine.engine import LLMEngine
from tetris.engine.kv_cache import KVCache, kv_bytes_per_block
from tetris.engine.model_runner import ModelRunner, _torch_decode_path
from tetris.engine.pipeline import (
    PipelineRunner,
    Stage,
    StageCache,
    drop_layers,
    layer_bytes,
)

__all__ = ["GroupMember", "layer_block_bytes", "member_blocks"]

_OTHER_PART = "<kunserve: another member's part>"
_WAIT_S = 120.0   # a peer's answer; a dead peer closes the link long before this


def layer_block_bytes(engine: LLMEngine) -> int:
    m = engine.model
    return kv_bytes_per_block(1, engine.blocks.block_size, m.local_num_kv_heads, m.head_dim,
                              m.dtype)


def member_blocks(engine: LLMEngine, start: int, end: int, reserve_bytes: int = 0) -> int:
    """Blocks of layers ``[start, end)`` that fit the cache's bytes plus the parameter bytes
    of the layers dropped (KunServe invariant 2: freed parameter memory becomes KV), less
    ``reserve_bytes`` kept for something else (a landing zone)."""
    model = engine.model
    freed = sum(layer_bytes(model.layers[i]) for i in range(model.num_layers)
                if not start <= i < end)
    kv = engine.cache.buffer.numel() * engine.cache.buffer.element_size()
    return (kv + freed - reserve_bytes) // ((end - start) * layer_block_bytes(engine))


class RemoteStage:
    """Layers ``[start, end)`` run on member ``member``; quacks as ``Stage`` for the runner
    (``model``, ``cache`` and ``runner`` are the local stage's: same block geometry)."""

    def __init__(self, owner: GroupMember, member: int, start: int, end: int, local: Stage):
        self.owner, self.member, self.start, self.end = owner, member, start, end
        self.model, self.cache, self.runner = local.model, local.cache, local.runner

    def run(self, hidden, positions, inputs, decode_only, meta):
        return self.owner.remote_stage(self.member, hidden, positions, inputs, decode_only)


class GroupMember:
    def __init__(self, engine: LLMEngine, member: int, host: str) -> None:
        self.engine = engine
        self.member = member
        self.links = GroupLinks(member, self._on_message)
        self.address = self.links.listen(host)
        self.ranges: list[tuple[int, int]] = []
        self.parts: list[tuple[int, int]] = []
        self.stage: Stage | None = None
        self.runner: PipelineRunner | None = None
        self.freed_param_bytes = 0
        self.base_blocks = 0             # the engine's blocks before the drop (restore's)
        self.exchange_bytes = 0          # KV bytes sent to other members (drop and restore)
        self.stage_runs = 0              # other members' batches run here
        self._inbox: queue.Queue = queue.Queue()          # exchange messages for drop/restore
        self._early: list[tuple[int, dict]] = []          # arrived before their _await
        self._landing: dict[str, tuple[set[int], Callable[[str], None]]] = {}
        self._results: dict[int, queue.Queue] = {}        # per peer: its stage's answers
        self._steps = 0
        self._lock = threading.Lock()
        self.closing = False

    def connect(self, addresses: list[tuple[str, int]], timeout_s: float) -> None:
        self._results = {k: queue.Queue() for k in range(len(addresses)) if k != self.member}
        self.links.connect([tuple(a) for a in addresses], timeout_s)

    # -- 2. drop --------------------------------------------------------------------------
    def check_drop(self, start: int, end: int, reserve_bytes: int = 0) -> int:
        """``member_blocks`` after checking the engine can join (``ValueError`` if not);
        ``reserve_bytes`` of the KV region stay out of the stage cache (the landing zone)."""
        e = self.engine
        if e.cache is None or not isinstance(e.runner, ModelRunner) or e.runner.graphs is not None:
            raise ValueError("only an undropped engine without CUDA graphs can join a group")
        if e.stats().receiving:
            raise ValueError("a request's KV is still arriving; drop after it")
        return member_blocks(e, start, end, reserve_bytes)

    def drop(self, ranges: list[tuple[int, int]], group_blocks: int,
             parts: list[tuple[int, int]]) -> int:
        """Returns the parameter bytes freed here."""
        e, me = self.engine, self.member
        self.ranges, self.parts = [tuple(r) for r in ranges], [tuple(p) for p in parts]
        start, end = self.ranges[me]
        lo, hi = self.parts[me]
        seqs = [s for s in e._seqs.values() if s.block_table]
        if sum(len(s.block_table) for s in seqs) > hi - lo:
            raise ValueError(f"member {me}'s requests hold more than its {hi - lo} blocks")
        self.check_drop(start, end)
        self.base_blocks = e.stats().total_blocks
        m, bs = e.model, e.blocks.block_size
        blocks = BlockManager(group_blocks, bs)
        blocks.withhold(_OTHER_PART, [b for b in range(group_blocks) if not lo <= b < hi])
        cache = StageCache(start, end, group_blocks, bs, m.local_num_kv_heads, m.head_dim,
                           dtype=m.dtype, device=m.device)
        old, new = self._renumber(seqs, blocks)
        whole = e.cache.buffer
        cache.buffer[:, :, new] = whole[start:end, :, old]
        for k in self.links.peers:   # each keeper gets its layers' KV of my requests
            s, t = self.ranges[k]
            kv = whole[s:t, :, old].clone()
            self.exchange_bytes += kv.numel() * kv.element_size()
            self.links.send(k, {"kind": "kv", "blocks": new, "kv": kv}, TrafficClass.BULK)
        for msg in self._await("kv", self.links.peers):
            cache.buffer[:, :, msg["blocks"]] = msg["kv"].to(cache.buffer.device)
        self.freed_param_bytes = drop_layers(m, start, end)
        self.stage = Stage(me, m, cache)
        stages = [self.stage if j == me else RemoteStage(self, j, s, t, self.stage)
                  for j, (s, t) in enumerate(self.ranges)]
        self.runner = PipelineRunner(stages)
        self.runner.hop = lambda hidden: hidden   # the remote stage carries it
        e.cache = None
        e.runner = self.runner
        e.blocks = e.batcher.blocks = blocks
        e._usable_blocks = hi - lo
        return self.freed_param_bytes

    @staticmethod
    def _renumber(seqs, blocks: BlockManager) -> tuple[torch.Tensor, torch.Tensor]:
        """New block ids from ``blocks`` for every sequence: (old ids, new ids), flat."""
        old, new = [], []
        for seq in seqs:
            old += seq.block_table
            seq.block_table = [blocks.reserve(seq.request_id) for _ in seq.block_table]
            new += seq.block_table
        return torch.tensor(old, dtype=torch.int64), torch.tensor(new, dtype=torch.int64)

    # -- while dropped: the pipeline ------------------------------------------------------
    def remote_stage(self, peer: int, hidden, positions, inputs, decode_only):
        """Run member ``peer``'s layers on this member's batch: an activation there and back."""
        with self._lock:
            self._steps += 1
            step = self._steps
        bare = msgspec.structs.replace(inputs, sample_seqs=[])   # no engine objects on the wire
        self.links.send(peer, {"kind": "stage", "step": step, "hidden": hidden,
                               "positions": positions, "inputs": bare,
                               "decode_only": decode_only}, TrafficClass.ACTIVATION)
        try:
            answer = self._results[peer].get(timeout=_WAIT_S)
        except queue.Empty:
            raise RuntimeError(f"member {peer} did not answer stage step {step}") from None
        if "error" in answer:
            raise RuntimeError(f"member {peer}'s stage failed: {answer['error']}")
        if answer["step"] != step:
            raise RuntimeError(f"member {peer} answered step {answer['step']}, not {step}")
        return answer["hidden"]

    def _serve_stage(self, peer: int, msg: dict) -> None:
        """The stage server: another member's batch through this member's layers."""
        try:
            inputs, hidden = msg["inputs"], msg["hidden"]
            meta = None
            if msg["decode_only"] and _torch_decode_path(self.stage.cache.buffer.device):
                meta = decode_meta(inputs.block_tables, inputs.context_lens,
                                   self.stage.cache.block_size, self.stage.cache.num_blocks,
                                   int(inputs.context_lens.max()))
            with torch.inference_mode():
                out = self.stage.run(hidden, msg["positions"], inputs, msg["decode_only"], meta)
            self.stage_runs += 1
            answer = {"kind": "result", "step": msg["step"], "hidden": out}
        except Exception as exc:  # noqa: BLE001 - the asking member fails its step with it
            answer = {"kind": "result", "step": msg["step"], "error": repr(exc)}
        self.links.send(peer, answer, TrafficClass.ACTIVATION)

    def _on_message(self, peer: int, msg: dict | None) -> None:
        kind = None if msg is None else msg["kind"]
        if kind == "stage":
            self._serve_stage(peer, msg)
        elif kind == "result":
            self._results[peer].put(msg)
        elif kind == "want":     # a restoring member asks for my layers' KV of its blocks
            kv = self.stage.cache.buffer[:, :, msg["blocks"]].clone()
            self.exchange_bytes += kv.numel() * kv.element_size()
            self.links.send(peer, {"kind": "kv_back", "member": self.member, "kv": kv},
                            TrafficClass.BULK)
        elif kind == "land":     # a member's newly prefilled request: KV of my layers
            self.stage.cache.buffer[:, :, msg["blocks"]] = msg["kv"].to(
                self.stage.cache.buffer.device)
            self.links.send(peer, {"kind": "landed", "rid": msg["rid"]}, TrafficClass.BULK)
        elif kind == "landed":
            self._landed_at(peer, msg["rid"])
        elif kind is None:       # the link broke: a member died (or the group closed)
            if not self.closing:
                for q in self._results.values():
                    q.put({"step": -1, "error": f"the link to member {peer} broke"})
                self._inbox.put((peer, {"kind": "lost"}))
        else:
            self._inbox.put((peer, msg))

    def _await(self, kind: str, peers: list[int]) -> list[dict]:
        """One ``kind`` message from every member of ``peers``, in member order. A message of
        another kind waits for its own ``_await`` (a peer may answer this member's ``want``
        before it sends its layers)."""
        got: dict[int, dict] = {}
        early, self._early = self._early, []
        for peer, msg in early:
            if msg["kind"] == kind and peer not in got:
                got[peer] = msg
            else:
                self._early.append((peer, msg))
        while len(got) < len(peers):
            try:
                peer, msg = self._inbox.get(timeout=_WAIT_S)
            except queue.Empty:
                raise RuntimeError(f"member {self.member}: no {kind} from members "
                                   f"{sorted(set(peers) - set(got))}") from None
            if msg["kind"] == "lost":
                raise RuntimeError(f"member {self.member}: member {peer} was lost during {kind}")
            if msg["kind"] != kind or peer in got:
                self._early.append((peer, msg))
                continue
            got[peer] = msg
        return [got[k] for k in sorted(got)]

    # -- while dropped: a prefilled request's KV, landed whole, goes to its layers' keepers --
    def land(self, rid: str, blocks: list[int], landing: KVCache, landing_ids: list[int],
             done: Callable[[str], None]) -> None:
        """The whole-model KV of ``rid`` arrived in ``landing`` (blocks ``landing_ids``): this
        member's layers go to its stage cache at the group ``blocks``, every other member's
        over the link as bulk; ``done(rid)`` once every keeper has written it."""
        new, old = torch.tensor(blocks), torch.tensor(landing_ids)
        start, end = self.ranges[self.member]
        self.stage.cache.buffer[:, :, new] = landing.buffer[start:end, :, old]
        with self._lock:
            self._landing[rid] = (set(self.links.peers), done)
        for k in self.links.peers:
            s, t = self.ranges[k]
            kv = landing.buffer[s:t, :, old].clone()
            self.exchange_bytes += kv.numel() * kv.element_size()
            self.links.send(k, {"kind": "land", "rid": rid, "blocks": new, "kv": kv},
                            TrafficClass.BULK)

    def _landed_at(self, peer: int, rid: str) -> None:
        with self._lock:
            waiting, done = self._landing.get(rid, (set(), None))
            waiting.discard(peer)
            if waiting or done is None:
                return
            del self._landing[rid]
        done(rid)

    # -- 3. restore -----------------------------------------------------------------------
    def check_restore(self, base_blocks: int) -> None:
        used = sum(len(s.block_table) for s in self.engine._seqs.values())
        if used > base_blocks:
            raise ValueError(f"member {self.member}'s requests hold {used} blocks, more than "
                             f"the {base_blocks} of a whole-model cache")
        if self.engine.stats().receiving:
            raise ValueError("a request's KV is still arriving; restore after it")

    def restore(self, base_blocks: int) -> int:
        """Back to an undropped replica; returns the parameter bytes pulled from peers."""
        self.check_restore(base_blocks)
        e, me = self.engine, self.member
        start, end = self.ranges[me]
        m = e.model
        held = {i: m.layers[i].state_dict() for i in range(start, end)}
        seqs = [s for s in e._seqs.values() if s.block_table]
        blocks = BlockManager(base_blocks, e.blocks.block_size)
        old, new = self._renumber(seqs, blocks)
        for k in self.links.peers:     # ask before sending layers: answers come sooner
            self.links.send(k, {"kind": "want", "blocks": old}, TrafficClass.BULK)
        for k in self.links.peers:
            self.links.send(k, {"kind": "layers", "layers": held}, TrafficClass.BULK)
        pulled = 0
        for msg in self._await("layers", self.links.peers):
            pulled += self._load_layers(msg["layers"])
        self._repack()
        cache = KVCache.for_model(m, base_blocks, e.blocks.block_size)
        cache.buffer[start:end, :, new] = self.stage.cache.buffer[:, :, old]
        for msg in self._await("kv_back", self.links.peers):
            s, t = self.ranges[msg["member"]]
            cache.buffer[s:t, :, new] = msg["kv"].to(cache.buffer.device)
        e.cache = cache
        e.runner = ModelRunner(m, cache, cuda_graphs=False)
        e.blocks = e.batcher.blocks = blocks
        e._usable_blocks = base_blocks
        return pulled

    def _load_layers(self, layers: dict[int, dict]) -> int:
        m = self.engine.model
        kept = next(layer for layer in m.layers if hasattr(layer, "self_attn"))
        pulled = 0
        for i, state in sorted(layers.items()):
            layer = type(kept)(m.cfg, m.tp_group, m.dtype, m.device)
            layer.load_state_dict(state)
            m.layers[i] = layer
            pulled += layer_bytes(layer)
        return pulled

    def _repack(self) -> None:
        """Pack the pulled layers' weights as ``LLMEngine`` packed the model's (CPU)."""
        m = self.engine.model
        start = self.ranges[self.member][0]
        if getattr(m.layers[start].mlp.gate_up, "packed", None) is not None:
            m.pack_weights(batch_hint=self.engine.batcher.max_num_seqs)

    def close(self) -> None:
        self.closing = True
        self.links.close()
