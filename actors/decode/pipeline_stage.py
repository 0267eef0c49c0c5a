"""A served decode rank as one member of a KunServe group (issue #24, §4.1-4.4).

After a drop, member j of a group keeps decoder layers ``ranges[j]`` of its own model copy
and a ``StageCache`` of those layers over the group's ``group_blocks`` blocks. The block ids
are the group's: member j's engine allocates only from its *part* ``parts[j]`` (every other
part is withheld in its block manager), so a request's blocks mean the same slots on every
member and no id is ever translated. Each member keeps its own requests, scheduler, sampler
and stop checks; its engine's runner is a ``ChainRunner`` (``stage_chain.py``): its own
layers run here (``Stage``), and its hidden states go from member to member in layer order
as activation messages through the pairs' priority links (``group_links.py``), each member
running its layers on its link's reader thread, the last sending them back to the owner.
With every member driving its own batch, the group has at least one micro-batch in flight
per member; with a ``MemberLookahead``, a member whose batch outweighs its peers' cuts it
into cost-balanced micro-batches (§4.3) so that the stages do not idle on it.

Lifecycle, driven by ``actors/decode/kunserve_group.py`` with every member's rounds paused:

1. ``GroupMember(engine, j, host)`` listens; ``connect`` joins the pair links.
2. ``drop(ranges, group_blocks, parts)``: the member's requests get blocks of its part; its
   own layers' KV is copied over locally and every other member's layers' KV is sent to it
   as bulk over the link (KV exchange: nothing is recomputed); it waits for the other
   members' KV of its layers, frees the layers it does not keep and switches the engine.
3. ``restore(base_blocks)``: the layers it dropped come back from their keepers (bulk), its
   requests get blocks of a whole-model cache again and each keeper sends back the KV of its
   layers for them; then ``close``.

A peer whose link breaks (the member died) fails every step waiting in the group (the
member seeing the break tells the others), a member that hangs fails the owner's step after
``step_timeout_s``; the instance breaks and its requests take the dispatcher's resume path.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch
from tetris.actors.decode.group_links import GroupLinks
from tetris.actors.decode.stage_chain import ChainRunner, RemoteStage
from tetris.transfer.traffic import TrafficClass

from tetris.engine.block_manager import BlockManager
from tetris.engine.engine import LLMEngine
from tetris.engine.kv_cache import KVCache, kv_bytes_per_block
from tetris.engine.model_runner import ModelRunner
from tetris.engine.pipeline import (
    Stage,
    StageCache,
    drop_layers,
    layer_bytes,
)
from tetris.scheduler.member_lookahead import MemberLookahead

__all__ = ["GroupMember", "layer_block_bytes", "member_blocks"]

_OTHER_PART = "<kunserve: another member's part>"
_WAIT_S = 120.0   # a peer's exchange message; a dead peer closes the link long before this
# A step's answers: a dead member closes its links (failing the step at once), so this only
# bounds a member that hangs with its sockets open; a loaded CPU step stays far below it.
STEP_TIMEOUT_S = 30.0


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


class GroupMember:
    def __init__(self, engine: LLMEngine, member: int, host: str, *,
                 step_timeout_s: float = STEP_TIMEOUT_S,
                 lookahead: MemberLookahead | None = None) -> None:
        self.engine = engine
        self.step_timeout_s = step_timeout_s
        self.lookahead = lookahead
        self.member = member
        self.links = GroupLinks(member, self._on_message)
        self.address = self.links.listen(host)
        self.ranges: list[tuple[int, int]] = []
        self.parts: list[tuple[int, int]] = []
        self.stage: Stage | None = None
        self.runner: ChainRunner | None = None
        self.dropped = False             # between drop and restore: the chain is in use
        self.freed_param_bytes = 0
        self.base_blocks = 0             # the engine's blocks before the drop (restore's)
        self.exchange_bytes = 0          # KV bytes sent to other members (drop and restore)
        self._inbox: queue.Queue = queue.Queue()          # exchange messages for drop/restore
        self._early: list[tuple[int, dict]] = []          # arrived before their _await
        self._landing: dict[str, tuple[set[int], Callable[[str], None]]] = {}
        self._lock = threading.Lock()
        self.closing = False

    def connect(self, addresses: list[tuple[str, int]], timeout_s: float) -> None:
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
        stages = [self.stage if j == me else RemoteStage(j, s, t, self.stage)
                  for j, (s, t) in enumerate(self.ranges)]
        self.runner = ChainRunner(me, stages, self.links, step_timeout_s=self.step_timeout_s,
                                  lookahead=self.lookahead)
        e.cache = None
        e.runner = self.runner
        e.blocks = e.batcher.blocks = blocks
        e._usable_blocks = hi - lo
        self.dropped = True
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

    # -- while dropped: the pipeline (stage_chain.py) ---------------------------------------
    @property
    def stage_runs(self) -> int:
        """Other members' micro-batches run through this member's layers."""
        return 0 if self.runner is None else self.runner.stage_runs

    def _on_message(self, peer: int, msg: dict | None) -> None:
        kind = None if msg is None else msg["kind"]
        if kind == "chain":
            if self.runner is None:   # not dropped (yet, or any more): the owner fails its step
                self.links.send(msg["owner"], {"kind": "result", "step": msg["step"],
                                               "mb": msg["mb"], "error": f"member {self.member}"
                                               " is not in the group's pipeline"},
                                TrafficClass.ACTIVATION)
            else:
                self.runner.on_chain(peer, msg)
        elif kind == "result":
            if self.runner is not None:
                self.runner.on_result(msg)
        elif kind == "member_lost":   # a peer saw a member's link break: the chain is broken
            if self.runner is not None:
                self.runner.fail(f"member {peer} lost member {msg['member']}")
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
                self._lost(peer)
            self._inbox.put((peer, {"kind": "lost"}))
        else:
            self._inbox.put((peer, msg))

    def _lost(self, peer: int) -> None:
        """Member ``peer``'s link broke: fail this member's steps and tell the others (a
        chain may be waiting on ``peer`` for an owner that has not seen the break yet). Not
        once restored: then the peers close their links one after the other."""
        if not self.dropped:
            return
        self.runner.fail(f"the link to member {peer} broke")
        for k in self.links.peers:
            if k != peer:
                try:
                    self.links.send(k, {"kind": "member_lost", "member": peer},
                                    TrafficClass.ACTIVATION)
                except (KeyError, OSError):
                    pass

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
        self.dropped = False
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
