"""A request's KV split by token range over several decode holders.

LoongServe's unified distributed KV pool (loongserve-notes §1.6): tokens are placed without
a locality constraint, so a request's KV may sit on several decode instances. Here a
*holder* is one decode instance's KV state (a paged ``KVCache`` and its ``BlockManager``,
as an ``LLMEngine`` has), and a request's KV is a list of ``KVShard`` in token order, each a
contiguous range ``[start, end)`` on one holder. The holder of the last range is the
request's *master*: its new KV is appended there (§1.4, multi-master decoding).

A holder answers one kind of question, the partial attention of a batch of queries over the
shards it holds, with the log-sum-exp that lets the master merge partials exactly
(``tetris.kernels.merge``). Shards are independent of the request's other ranges: each
starts at its own first block, so its slots are local token offsets ``t - start``.
"""

from __future__ import annotations

import torch

from tetris.engine.block_manager import BlockManager, blocks_for
from tetris.engine.kv_cache import KVCache
from tetris.kernels.merge import merge_attention
from tetris.kernels.paged_decode import paged_decode_attention_with_lse, write_kv

__all__ = ["KVShard", "ShardHolder", "ShardedRequest"]


class KVShard:
    """Tokens ``[start, start + num_tokens)`` of ``request`` on holder ``holder``.

    ``request_id`` names the block owner for the ``BlockManager`` (the request and the range's
    start: a holder may keep two ranges of one request after its master moved away and back).
    """

    def __init__(self, request: str, holder: int, start: int) -> None:
        self.request = request
        self.holder = holder
        self.start = start
        self.num_tokens = 0
        self.block_table: list[int] = []

    @property
    def request_id(self) -> str:
        return f"{self.request}@{self.start}"

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def __repr__(self) -> str:
        return f"KVShard({self.request}, holder={self.holder}, [{self.start}, {self.end}))"


class ShardHolder:
    """One decode instance's KV: ``num_blocks`` x ``block_size`` slots shaped for ``model``."""

    def __init__(self, index: int, model, num_blocks: int, block_size: int) -> None:
        self.index = index
        self.model = model
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size)
        self.cache = KVCache.for_model(model, num_blocks, block_size)

    @classmethod
    def of_engine(cls, index: int, engine) -> ShardHolder:
        """A holder on an ``LLMEngine``'s own cache and block manager: its ranges take blocks
        from the pool the engine's sequences use (a decode instance holding ranges for
        masters elsewhere beside its own batch; ``engine.num_free_blocks`` counts them)."""
        holder = cls.__new__(cls)
        holder.index = index
        holder.model = engine.model
        holder.blocks = engine.blocks
        holder.block_size = engine.blocks.block_size
        holder.cache = engine.cache
        return holder

    @property
    def free_tokens(self) -> int:
        return self.blocks.num_free_blocks * self.block_size

    def can_hold(self, num_tokens: int) -> bool:
        return self.blocks.can_allocate(num_tokens)

    def open_shard(self, request: str, start: int, num_tokens: int) -> KVShard:
        """A new range of ``num_tokens`` tokens from ``start``, its blocks taken now."""
        shard = KVShard(request, self.index, start)
        shard.num_tokens = num_tokens
        self.blocks.allocate(shard)
        return shard

    def can_grow(self, shard: KVShard) -> bool:
        """Whether ``shard`` can take one more token (a new block only at a block boundary)."""
        fits = blocks_for(shard.num_tokens + 1, self.block_size) <= len(shard.block_table)
        return fits or self.blocks.num_free_blocks > 0

    def grow(self, shard: KVShard) -> int:
        """Give ``shard`` one more token; returns that token's cache slot."""
        shard.num_tokens += 1
        self.blocks.append_slot(shard)
        return self.slot(shard, shard.num_tokens - 1)

    def slot(self, shard: KVShard, offset: int) -> int:
        """Cache slot of the shard's ``offset``-th token (absolute position start + offset)."""
        return shard.block_table[offset // self.block_size] * self.block_size + offset % self.block_size

    def write(self, layer: int, shard: KVShard, offset: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k, v [n, Hkv, D] at the shard's offsets ``[offset, offset + n)``."""
        slots = torch.tensor([self.slot(shard, offset + i) for i in range(k.shape[0])],
                             dtype=torch.int64, device=self.cache.buffer.device)
        write_kv(self.cache.k[layer], self.cache.v[layer], k, v, slots)

    def partial(self, layer: int, q: torch.Tensor, rows: list[list[KVShard]]):
        """Attention of q [B, Hq, D] over row b's shards ``rows[b]`` (all on this holder).

        Returns (out [B, Hq, D], lse [Hq, B] fp32): the softmax over exactly those keys and
        its log-sum-exp, so the master can merge it with the request's other partials.
        Every key of a shard is visible: shards hold the past of the query (and the master's
        own shard its newest token, written before this call).
        """
        if any(s.holder != self.index for shards in rows for s in shards):
            raise ValueError(f"holder {self.index} asked about a shard it does not hold")
        flat = [(b, s) for b, shards in enumerate(rows) for s in shards]
        width = max((len(s.block_table) for _, s in flat), default=0)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table))
                               for _, s in flat], dtype=torch.int32).reshape(len(flat), width)
        lens = torch.tensor([s.num_tokens for _, s in flat], dtype=torch.int32)
        index = torch.tensor([b for b, _ in flat], dtype=torch.int64)
        out, lse = paged_decode_attention_with_lse(q.index_select(0, index), self.cache.k[layer],
                                                   self.cache.v[layer], tables, lens)
        return _fold_rows(out, lse.transpose(0, 1), [b for b, _ in flat], q.shape[0])

    def free(self, shard: KVShard) -> None:
        self.blocks.free(shard)


def _fold_rows(out: torch.Tensor, lse: torch.Tensor, owner: list[int], num_rows: int):
    """Merge partial rows that belong to one query (a row with two shards on one holder):
    out [N, Hq, D] and lse [Hq, N] with row i of query ``owner[i]`` -> [num_rows, ...]."""
    first: dict[int, int] = {}
    for i, b in enumerate(owner):
        first.setdefault(b, i)
    if len(first) == num_rows == len(owner):
        return out, lse
    res_out = out.new_zeros(num_rows, *out.shape[1:])
    res_lse = torch.full((lse.shape[0], num_rows), float("-inf"), dtype=torch.float32)
    for i, b in enumerate(owner):
        o, s = merge_attention(res_out[b:b + 1], res_lse[:, b:b + 1], out[i:i + 1], lse[:, i:i + 1])
        res_out[b:b + 1], res_lse[:, b:b + 1] = o, s
    return res_out, res_lse


class ShardedRequest:
    """A decoding request: its tokens (prompt, then outputs) and its KV ranges in order.

    ``num_cached`` tokens have KV; the next step's input is ``tokens[num_cached]`` (the last
    sampled token), whose KV the step appends at the master.
    """

    def __init__(self, request_id: str, tokens: list[int], shards: list[KVShard],
                 max_tokens: int) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.shards = shards
        self.num_prompt = len(tokens) - 1
        self.max_tokens = max_tokens

    @property
    def master(self) -> int:
        return self.shards[-1].holder

    @property
    def num_cached(self) -> int:
        return self.shards[-1].end

    @property
    def holders(self) -> list[int]:
        """Holders of any range of this request, ascending."""
        return sorted({s.holder for s in self.shards})

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens

    def shards_on(self, holder: int) -> list[KVShard]:
        return [s for s in self.shards if s.holder == holder]
