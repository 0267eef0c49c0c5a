"""Multi-master decode over KV shards: the query moves, the KV stays.

LoongServe's multi-master distributed decoding (loongserve-notes §1.4) and CSPS's SP decode
(csps-notes §1.11): each request has one master, the holder of its newest tokens; other
holders keep earlier token ranges of its KV. One step, in lockstep over every holder:

1. each master embeds its requests' input tokens (one per request);
2. per layer, each master computes q, k, v for its rows and appends k, v to its own shard;
3. it sends q to every other holder of each row's request (``QueryBatch``: one message per
   (master, holder) pair and layer, rows of several requests together);
4. each holder computes partial attention with the LSE over its shards of those requests and
   sends them back (``PartialBatch``); the master computes its own shard's partial;
5. the master merges the partials by LSE (kernels/merge.py: exact), runs o_proj and the MLP;
6. after the last layer the master samples (greedy) and the token is appended.

A holder is master for some requests and a plain holder for others in the same step; a
request whose KV sits on one holder sends nothing. Per sharded request and layer the bytes
moved are q to each of the other P-1 holders and (out, lse) back: csps-notes §2.5's
"Q broadcast" row. No KV moves after placement: when the master's holder has no free block
for the next token, the request opens a new range on another holder, which becomes the
master (the split moves as tokens are appended; LoongServe's memory-triggered scale-up).

This module is the engine-level mechanism, in process: the holders are objects and the
messages are passed by the driver (``traffic`` records them). Decode actors carry the same
messages between instances; see docs/decode.md "Elastic decode".

``place_prefilled`` stands in for the prefill members' streaming: it computes the prompt's KV
and writes each token range only into the holder that will keep it (LoongServe §1.3's
proactive scale-down, in P/D form).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import torch

from tetris.engine.block_manager import OutOfBlocksError
from tetris.engine.kv_shards import ShardedRequest, ShardHolder
from tetris.engine.sampling import greedy_tokens
from tetris.kernels import dispatch
from tetris.kernels.merge import merge_attention

__all__ = ["PartialBatch", "QueryBatch", "ShardedDecoder", "most_free_holder"]


class QueryBatch(msgspec.Struct):
    """Master -> holder: the queries of ``request_ids`` at ``layer``; q [n, Hq, D]."""

    layer: int
    master: int
    holder: int
    request_ids: tuple[str, ...]
    q: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size()


class PartialBatch(msgspec.Struct):
    """Holder -> master: out [n, Hq, D] and lse [Hq, n] fp32 over the holder's shards."""

    layer: int
    master: int
    holder: int
    request_ids: tuple[str, ...]
    out: torch.Tensor
    lse: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.out.numel() * self.out.element_size() + self.lse.numel() * self.lse.element_size()


NextMaster = Callable[[ShardedRequest, Sequence[ShardHolder]], ShardHolder | None]


def most_free_holder(request: ShardedRequest, holders: Sequence[ShardHolder]) -> ShardHolder | None:
    """The holder with the most free slots that has a block (ties: lowest index), else None."""
    room = [h for h in holders if h.can_hold(1)]
    return max(room, key=lambda h: (h.free_tokens, -h.index), default=None)


class ShardedDecoder:
    """Decodes ``ShardedRequest``s over ``holders`` (which all run the same model weights)."""

    def __init__(self, model, holders: Sequence[ShardHolder], *,
                 next_master: NextMaster = most_free_holder) -> None:
        if [h.index for h in holders] != list(range(len(holders))):
            raise ValueError("holders must be indexed 0..n-1 in order")
        self.model = model
        self.holders = list(holders)
        self.next_master = next_master
        self.requests: dict[str, ShardedRequest] = {}
        self.traffic: list[QueryBatch | PartialBatch] = []  # the last step's messages
        self.logits: dict[str, torch.Tensor] = {}  # the last step's logits [V] per request

    # -- placement ---------------------------------------------------------------------------

    @torch.inference_mode()
    def place_prefilled(self, request_id: str, prompt: Sequence[int],
                        ranges: Sequence[tuple[int, int, int]], max_tokens: int) -> int:
        """Prefill ``prompt`` and keep each range ``(holder, start, end)`` of its KV on that
        holder only; the ranges tile ``[0, len(prompt))`` in order. Returns the first token."""
        n = len(prompt)
        if request_id in self.requests:
            raise ValueError(f"{request_id} is already decoding")
        starts = [r[1] for r in ranges]
        ends = [r[2] for r in ranges]
        if not ranges or starts[0] != 0 or ends[-1] != n or starts[1:] != ends[:-1] \
                or any(e <= s for s, e in zip(starts, ends)):
            raise ValueError(f"ranges {list(ranges)} do not tile [0, {n}) in order")
        if not all(self.holders[h].can_hold(e - s) for h, s, e in ranges):
            raise OutOfBlocksError(f"{request_id}: a holder has no room for its range")
        shards = [self.holders[h].open_shard(request_id, s, e - s) for h, s, e in ranges]

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            for shard in shards:  # each range's KV reaches its own holder, nowhere else
                rows = slice(shard.start, shard.end)
                self.holders[shard.holder].write(layer, shard, 0, k[rows], v[rows])
            return dispatch.attention_with_lse(q, k, v, causal=True)[0]

        ids = torch.tensor(list(prompt), dtype=torch.int64)
        hidden = self.model.forward(ids, torch.arange(n), attention)
        first = int(greedy_tokens(self.model.logits(hidden[-1:], upcast=False))[0])
        self.requests[request_id] = ShardedRequest(request_id, list(prompt) + [first], shards,
                                                   max_tokens)
        return first

    def free(self, request_id: str) -> None:
        """Free every range of the request on every holder (abort or completion)."""
        request = self.requests.pop(request_id)
        for shard in request.shards:
            self.holders[shard.holder].free(shard)

    # -- the step ----------------------------------------------------------------------------

    def _append_slots(self, live: list[ShardedRequest]) -> list[int]:
        """Give every request's input token a slot at its master; a master whose holder is
        full hands over to ``next_master`` (a new range there). Returns each one's slot."""
        slots = []
        for request in live:
            shard = request.shards[-1]
            holder = self.holders[shard.holder]
            if not holder.can_grow(shard):
                target = self.next_master(request, self.holders)
                if target is None:
                    raise OutOfBlocksError(f"{request.request_id}: no holder has a free block")
                shard = target.open_shard(request.request_id, shard.end, 0)
                request.shards.append(shard)
                holder = target
            slots.append(holder.grow(shard))
        return slots

    @torch.inference_mode()
    def step(self) -> dict[str, int]:
        """One decode step of every unfinished request; returns each one's new token."""
        live = [r for r in self.requests.values() if not r.finished]
        if not live:
            return {}
        self._append_slots(live)
        self.traffic = []
        self.logits = {}
        masters = sorted({r.master for r in live})
        rows = {m: [r for r in live if r.master == m] for m in masters}
        hidden = {}
        positions = {}
        for m in masters:
            positions[m] = torch.tensor([r.num_cached - 1 for r in rows[m]], dtype=torch.int64)
            ids = torch.tensor([r.tokens[r.num_cached - 1] for r in rows[m]], dtype=torch.int64)
            hidden[m] = self.model.embed(ids)
        for layer in range(self.model.num_layers):
            qs = {}
            for m in masters:
                q, k, v = self.model.layer_qkv(layer, hidden[m], positions[m])
                holder = self.holders[m]
                for i, r in enumerate(rows[m]):
                    shard = r.shards[-1]
                    holder.write(layer, shard, shard.num_tokens - 1, k[i:i + 1], v[i:i + 1])
                qs[m] = q
            attn = self._attention(layer, masters, rows, qs)
            for m in masters:
                hidden[m] = self.model.layer_attn_out(layer, hidden[m], attn[m])
                hidden[m] = self.model.layer_mlp(layer, hidden[m])
        new = {}
        for m in masters:
            logits = self.model.logits(self.model.final_norm(hidden[m]), upcast=False)
            for r, row, token in zip(rows[m], logits, greedy_tokens(logits).tolist(), strict=True):
                r.tokens.append(token)
                self.logits[r.request_id] = row
                new[r.request_id] = token
        return new

    def _attention(self, layer: int, masters: list[int], rows: dict[int, list[ShardedRequest]],
                   qs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Steps 3-5 for one layer: queries out, partials back, merged at each master."""
        queries: list[QueryBatch] = []
        for m in masters:
            for h in range(len(self.holders)):
                picked = [i for i, r in enumerate(rows[m]) if h != m and r.shards_on(h)]
                if picked:
                    queries.append(QueryBatch(layer, m, h, tuple(rows[m][i].request_id for i in picked),
                                              qs[m][picked]))
        partials = [self._answer(query) for query in queries]  # each holder, in parallel live
        self.traffic += queries + partials
        attn = {}
        for m in masters:
            own = [r.shards_on(m) for r in rows[m]]
            out, lse = self.holders[m].partial(layer, qs[m], own)
            position = {r.request_id: i for i, r in enumerate(rows[m])}
            for part in (p for p in partials if p.master == m):  # holder order: deterministic
                index = torch.tensor([position[rid] for rid in part.request_ids])
                merged, merged_lse = merge_attention(out[index], lse[:, index], part.out, part.lse)
                out[index] = merged
                lse[:, index] = merged_lse
            attn[m] = out
        return attn

    def _answer(self, query: QueryBatch) -> PartialBatch:
        """What holder ``query.holder`` computes on receiving ``query``."""
        holder = self.holders[query.holder]
        shards = [self.requests[rid].shards_on(holder.index) for rid in query.request_ids]
        out, lse = holder.partial(query.layer, query.q, shards)
        return PartialBatch(query.layer, query.master, query.holder, query.request_ids, out, lse)
