"""Elastic decode inside a running ``LLMEngine``: rows whose KV is split over decode instances.

The live form of ``sharded_decode.py``'s multi-master step (loongserve-notes §1.4, csps-notes
§1.11). Every decode instance of an *elastic world* runs its own ``LLMEngine`` with its own
batch; an ``ElasticRows`` on its model runner (``ModelRunner.elastic``) plays both roles of a
step, per layer, between the engine's own layers:

- **master**: a request's newest range is an ordinary sequence of this engine whose table
  starts at ``kv_start`` (``LLMEngine.reserve_blocks(kv_start=...)``); its new KV is
  appended here as for any request. Its decode attention computes the local partial with the
  LSE, sends the row's q to every other holder of the request (one ``q`` tensor per peer and
  layer, rows of several requests together) and merges the returned partials by LSE
  (kernels/merge.py: exact);
- **holder**: it keeps ranges ``[start, end)`` of requests mastered elsewhere as ``KVShard``s
  in its own block pool (``ShardHolder.of_engine``) and answers the queries of their masters
  with the partial attention (out, LSE) over them.

Lockstep: every instance of the world calls ``begin`` (inside its engine's forward) or
``idle_step`` (when its engine ran no forward) exactly once per round, then meets its peers
once per layer. ``begin`` exchanges a header with each peer (how many rows it will ask about
and their keys), so each side knows the shapes it receives and which pairs carry traffic; a
pair with nothing to ask in a step exchanges no layer messages.

The transport is any *peer link* (``isend``/``irecv`` by world rank, each returning a work to
``wait`` on), e.g. the prefill pool's ``World`` (a gloo group of its own): with TP, rank r of
every instance joins one world and exchanges its head slice of q and of the partials. A
request is named on the wire by an integer ``key`` the driver gives every member.
"""

from __future__ import annotations

import msgspec
import torch

from tetris.engine import elastic_handover as handover
from tetris.engine.block_manager import OutOfBlocksError
from tetris.engine.kv_shards import KVShard, ShardHolder
from tetris.engine.master_room import preempt_for_masters
from tetris.kernels import dispatch
from tetris.kernels.merge import merge_attention
from tetris.kernels.paged_decode import paged_decode_attention_with_lse

__all__ = ["ElasticRows", "ExchangeCounts"]


class ExchangeCounts(msgspec.Struct):
    """Bytes this rank sent: ``data`` (q and partials) and ``header`` (row counts and keys)."""

    data: int = 0
    header: int = 0
    messages: int = 0


class _Master(msgspec.Struct):
    key: int
    holders: list[int]   # the other instances holding ranges of the request, ascending
    line: list[int] = []   # heirs, in order: who masters next when this instance is full


class _Held(msgspec.Struct):
    request_id: str
    master: int
    shards: list[KVShard]


class _Heir(msgspec.Struct):
    request_id: str
    prompt: list[int]
    params: object       # SamplingParams


class ElasticRows:
    """Instance ``index`` of an elastic world of ``size`` decode instances, on ``engine``."""

    def __init__(self, engine, index: int, size: int, link) -> None:
        if not 0 <= index < size:
            raise ValueError(f"instance {index} outside an elastic world of {size}")
        self.engine = engine
        self.index = index
        self.peers = [p for p in range(size) if p != index]
        self.link = link
        self.holder = ShardHolder.of_engine(index, engine)
        self._masters: dict[str, _Master] = {}
        self._held: dict[int, _Held] = {}                  # key -> ranges held here
        self.counts = ExchangeCounts()
        self.lost: set[int] = set()        # peers whose link broke: never asked again
        self.failed: list[str] = []        # masters' requests that lost a holder (``round``)
        # splits that move as tokens are appended (engine/elastic_handover.py)
        self._heirs: dict[int, _Heir] = {}                 # key -> what an heir needs
        self._outgoing: list[tuple[list[int], handover.Handover]] = []   # (to, record)
        self._adoptions: list[handover.Handover] = []      # adopted at the next round
        self.handovers: list[tuple[str, int, int, int]] = []   # (request, from, to, at n)
        self._step: _Step | None = None
        self._attach(engine)

    def _attach(self, engine) -> None:
        """Become the engine's decode-attention hook (``ModelRunner.elastic``)."""
        if engine.runner.elastic is not None:
            raise ValueError("this engine already takes part in an elastic world")
        cfg = engine.model.cfg
        self._group = cfg.num_heads // cfg.num_kv_heads   # q heads per KV head
        engine.runner.elastic = self

    # -- placement (the driver's commands) ----------------------------------------------------

    def master(self, request_id: str, key: int, holders: list[int], line=()) -> None:
        """This engine masters ``request_id`` (reserved with ``kv_start`` > 0); ``holders``
        keep its earlier ranges; ``line``: holders that master next, in order, when this
        instance has no block for the next token (each told the request by ``heir``)."""
        if self.index in holders or not holders:
            raise ValueError(f"{request_id}: holders {holders} must be other instances")
        if any(h not in holders for h in line):
            raise ValueError(f"{request_id}: line {list(line)} must be among holders {holders}")
        self._masters[request_id] = _Master(key, sorted(holders), list(line))

    def heir(self, request_id: str, key: int, prompt, params) -> None:
        """This instance is in ``request_id``'s line: what it needs to master the request."""
        self._heirs[key] = _Heir(request_id, list(prompt), params)

    def hold(self, request_id: str, key: int, master: int, start: int,
             num_tokens: int) -> KVShard:
        """Keep tokens ``[start, start + num_tokens)`` of a request mastered by ``master``;
        blocks from this engine's pool now (write its KV with ``self.holder.write``)."""
        if master == self.index:
            raise ValueError(f"{request_id}: a master keeps its own range as a sequence")
        shard = self.holder.open_shard(request_id, start, num_tokens)
        held = self._held.setdefault(key, _Held(request_id, master, []))
        held.shards.append(shard)
        return shard

    def release(self, request_id: str) -> None:
        """Forget ``request_id`` here (finished, aborted or lost): ranges held are freed; a
        master's own sequence is the engine's to free."""
        self._masters.pop(request_id, None)
        for key in [k for k, h in self._held.items() if h.request_id == request_id]:
            for shard in self._held.pop(key).shards:
                self.holder.free(shard)
        for key in [k for k, h in self._heirs.items() if h.request_id == request_id]:
            del self._heirs[key]
            self._adoptions = [r for r in self._adoptions if r.key != key]

    def holds(self, request_id: str) -> bool:
        return request_id in self._masters or any(h.request_id == request_id
                                                  for h in self._held.values())

    # -- one round ----------------------------------------------------------------------------

    def round(self):
        """One engine step in the world's lockstep: (outputs, failed request ids). A request
        that lost a holder this step is aborted here and its output of the step dropped (its
        merge missed a range): the caller sends it down the resume path."""
        self._adopt_pending()
        self._hand_over_full()
        preempt_for_masters(self.engine)   # whole requests yield first (engine/master_room.py)
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        self.end_step()
        failed, self.failed = self.failed, []
        for rid in failed:
            self.engine.abort_request(rid)
        gone = set(failed)
        return [o for o in outputs if o.request_id not in gone], failed

    # -- a split that moves as tokens are appended (engine/elastic_handover.py) -------------

    def _hand_over_full(self) -> None:
        """Before the step: while the batch's decode rows need more new blocks than are free,
        hand masters that need one to their next heir (sorted by request: deterministic)."""
        lined = [(rid, m) for rid, m in sorted(self._masters.items()) if m.line]
        if not lined:
            return
        engine = self.engine
        size = engine.blocks.block_size
        decoding = [s for s in engine.batcher.running if s.num_computed and s.num_uncomputed == 1]
        need = sum(handover.needs_block(s, size) for s in decoding)
        for rid, entry in lined:
            if need <= engine.num_free_blocks:
                return
            seq = engine._seqs.get(rid)
            heirs = [h for h in entry.line if h not in self.lost]
            if seq in decoding and handover.needs_block(seq, size) and heirs:
                self._hand_over(rid, entry, heirs)
                need -= 1

    def _hand_over(self, request_id: str, entry: _Master, heirs: list[int]) -> None:
        shard, seq = handover.detach(self.engine, request_id, self.index)
        heir = heirs[0]
        holders = sorted({*entry.holders, self.index} - {heir})
        record = handover.handover_of(seq, entry.key, heir, holders, heirs[1:])
        del self._masters[request_id]
        held = self._held.setdefault(entry.key, _Held(request_id, heir, []))
        held.master = heir
        held.shards.append(shard)
        self._outgoing.append((list(entry.holders), record))
        self.handovers.append((request_id, self.index, heir, record.num_kv))

    def _records_for(self, peers: list[int]) -> dict[int, list[int]]:
        """This round's handover records as header words per peer (then forgotten)."""
        words: dict[int, list[int]] = {p: [] for p in peers}
        for members, record in self._outgoing:
            for p in members:
                if p in words:
                    words[p] += record.words()
        self._outgoing = []
        return words

    def _take_records(self, peer: int, words: list[int]) -> None:
        """Records from an old master: ranges held here now answer the new master; the heir
        adopts the request at its next round."""
        for record in handover.decode_records(words):
            held = self._held.get(record.key)
            if held is not None:
                held.master = record.master
            if record.master == self.index:
                self._adoptions.append(record)

    def _adopt_pending(self) -> None:
        adoptions, self._adoptions = self._adoptions, []
        for record in adoptions:
            heir = self._heirs.pop(record.key, None)
            if heir is None:
                raise RuntimeError(f"instance {self.index}: handed request key {record.key} "
                                   "without being told it (ElasticRows.heir)")
            try:
                handover.adopt(self.engine, heir.request_id, heir.prompt, heir.params, record)
            except OutOfBlocksError:   # no room here either: the resume path, as for a loss
                self.failed.append(heir.request_id)
                continue
            self._masters[heir.request_id] = _Master(record.key, sorted(record.holders),
                                                     list(record.line))

    @property
    def live_peers(self) -> list[int]:
        return [p for p in self.peers if p not in self.lost]

    def begin(self, seqs) -> None:
        """The engine's decode rows this step, in batch order: the header exchange."""
        peers = self.live_peers
        asks = {p: [] for p in peers}   # peer -> [(row, key)]
        own = {}                        # row -> ranges held here of a request mastered here
        for row, seq in enumerate(seqs):
            entry = self._masters.get(seq.request_id)
            if entry is None:
                continue
            for p in entry.holders:
                if p in asks:
                    asks[p].append((row, entry.key))
            if entry.key in self._held:   # mastered here after a handover (elastic_handover)
                own[row] = self._held[entry.key].shards
        records = self._records_for(peers)
        counts = self._exchange(
            {p: [torch.tensor([_pack(len(asks[p]), len(records[p]))], dtype=torch.int64)]
             for p in peers},
            {p: [((1,), torch.int64)] for p in peers}, header=True)
        wanted = {p: _unpack(int(c[0][0])) for p, c in counts.items()}
        keys = self._exchange(
            {p: [torch.tensor([k for _, k in asks[p]] + records[p], dtype=torch.int64)]
             for p in self.live_peers if asks[p] or records[p]},
            {p: [((sum(n),), torch.int64)] for p, n in wanted.items() if sum(n)}, header=True)
        answers = {}
        for p, (ks,) in keys.items():
            rows = wanted[p][0]
            self._take_records(p, ks[rows:].tolist())
            if not rows:
                continue
            held = [self._held.get(int(k)) for k in ks[:rows]]
            if any(h is None or h.master != p for h in held):
                raise RuntimeError(f"instance {self.index}: instance {p} asks about ranges "
                                   f"it does not hold here (keys {ks.tolist()})")
            answers[p] = [h.shards for h in held]
        self._step = _Step({p: [r for r, _ in a] for p, a in asks.items()
                            if a and p not in self.lost}, answers, own)

    def decode_attention(self, layer: int, q, k_cache, v_cache, block_tables, context_lens):
        """The engine's decode attention of ``q`` [B, Hq, D] at ``layer`` (its new KV already
        written), merged with the holders' partials; answers the queries of other masters."""
        step = self._step
        if step is None:
            raise RuntimeError("decode attention before begin(): not an elastic engine step")
        if not step.asks and not step.own:
            out = (dispatch.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                   context_lens) if q.shape[0] else q.clone())
            self._answer(layer, step, {})
            return out
        out, lse = paged_decode_attention_with_lse(q, k_cache, v_cache, block_tables,
                                                   context_lens)
        lse = lse.transpose(0, 1).contiguous()           # [Hq, B], as merge_attention takes
        parts = self._answer(layer, step, {p: [q[rows].contiguous()]
                                           for p, rows in step.asks.items()})
        merges = [(step.asks[p], *parts[p]) for p in sorted(parts)]   # peer order: deterministic
        if step.own:   # ranges this master computed before it handed over and got back
            own = sorted(step.own)
            merges.insert(0, (own, *self._partial(layer, q[own], [step.own[r] for r in own])))
        for row_list, part_out, part_lse in merges:
            rows = torch.tensor(row_list, dtype=torch.int64)
            merged, merged_lse = merge_attention(out[rows], lse[:, rows], part_out, part_lse)
            out[rows] = merged
            lse[:, rows] = merged_lse
        return out

    def idle_step(self) -> None:
        """A round in which the engine ran no forward: still answer every layer's queries."""
        if self._step is None:
            self.begin([])
        for layer in range(self.engine.cache.num_layers):
            self._answer(layer, self._step, {})
        self._step = None

    def end_step(self) -> None:
        """After the engine's step: an idle engine still answers (``idle_step``)."""
        if self._step is None:
            self.idle_step()
        self._step = None

    def _answer(self, layer: int, step: _Step, queries: dict[int, list[torch.Tensor]]):
        """One layer's two exchanges: queries out and in, then partials out and back."""
        heads, dim = self._heads()
        dtype = self._dtype(layer)
        got = self._exchange(queries, {p: [((len(s), heads, dim), dtype)]
                                       for p, s in step.answers.items()})
        replies = {}
        for p, (q,) in got.items():
            out, lse = self._partial(layer, q, step.answers[p])
            replies[p] = [out.contiguous(), lse.contiguous()]
        return {p: tuple(t) for p, t in self._exchange(
            replies, {p: [((len(rows), heads, dim), dtype), ((heads, len(rows)), torch.float32)]
                      for p, rows in step.asks.items()}).items()}

    def _partial(self, layer: int, q: torch.Tensor, rows: list[list[KVShard]]):
        return self.holder.partial(layer, q, rows)

    def _dtype(self, layer: int) -> torch.dtype:
        return self.engine.cache.k[layer].dtype

    def _heads(self) -> tuple[int, int]:
        """(local q heads, head dim) of this rank's cache slice."""
        _, _, kv_heads, dim = self.engine.cache.k[0].shape
        return kv_heads * self._group, dim

    def _exchange(self, sends: dict[int, list[torch.Tensor]],
                  recvs: dict[int, list[tuple[tuple[int, ...], torch.dtype]]], *,
                  header: bool = False) -> dict[int, list[torch.Tensor]]:
        """Post every send and receive at once (no pair order to deadlock on), wait for all.
        A peer whose send or receive fails is lost (``_lose``); only live peers' tensors are
        returned."""
        sends = {p: t for p, t in sends.items() if p not in self.lost}
        recvs = {p: s for p, s in recvs.items() if p not in self.lost}
        works = []
        for p in sorted(sends):
            for tag, t in enumerate(sends[p]):
                works.append((p, self.link.isend(t, p, tag)))
                nbytes = t.numel() * t.element_size()
                if header:
                    self.counts.header += nbytes
                else:
                    self.counts.data += nbytes
                self.counts.messages += 1
        got = {p: [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
               for p, specs in sorted(recvs.items())}
        for p, tensors in got.items():
            for tag, t in enumerate(tensors):
                works.append((p, self.link.irecv(t, p, tag)))
        for p, w in works:
            try:
                w.wait()
            except RuntimeError as exc:   # gloo: the peer closed or timed out
                self._lose(p, exc)
        return {p: t for p, t in got.items() if p not in self.lost}

    def _lose(self, peer: int, exc: Exception) -> None:
        """``peer`` is gone: its masters' ranges here are freed at once, and every request
        mastered here with a range there fails (``round`` aborts it; not asked again)."""
        if peer in self.lost:
            return
        self.lost.add(peer)
        for key in [k for k, h in self._held.items() if h.master == peer]:
            for shard in self._held.pop(key).shards:
                self.holder.free(shard)
        for rid in sorted(r for r, m in self._masters.items() if peer in m.holders):
            del self._masters[rid]
            self.failed.append(rid)
        if self._step is not None:
            self._step.asks.pop(peer, None)
            self._step.answers.pop(peer, None)


class _Step(msgspec.Struct):
    asks: dict[int, list[int]]                 # peer -> my batch rows whose ranges it holds
    answers: dict[int, list[list[KVShard]]]    # peer -> per row it asks, my ranges of it
    own: dict[int, list[KVShard]] = {}         # my row -> its ranges held here (handover)


def _pack(rows: int, extra: int) -> int:
    """A header's one word: rows asked about and handover words after their keys (an idle
    round still sends 8 bytes per peer)."""
    return rows | extra << 32


def _unpack(word: int) -> tuple[int, int]:
    return word & 0xFFFFFFFF, word >> 32
