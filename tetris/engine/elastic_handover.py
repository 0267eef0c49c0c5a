"""A split that moves as tokens are appended: a full master hands its request to the next
holder in line, in a running engine (engine/elastic_rows.py), without moving any KV.

LoongServe's elastic scale-up at decode time (loongserve-notes §1.4-1.6): a request's newest
range grows at its master; when the master's instance has no free block for the next token,
the next instance of the request's *line* (holders named at placement, each told the request's
prompt and sampling parameters: ``ElasticRows.heir``) becomes master and new KV is appended
there. What the old master computed stays where it is: its range ``[kv_start, n)`` becomes a
held range of the old master (the sequence's blocks, kept under its name), answered like any
other. ``sharded_decode.py`` does the same in process (``ShardedDecoder._append_slots``).

Lifecycle, in the world's rounds (every member runs ``ElasticRows.round`` once per round):

1. round k, before its engine steps, the master finds that the decode rows of its batch need
   more new blocks than are free and that the request has an heir: it takes the request's
   sequence out of its engine (``detach``; the request gets no token this round) and queues a
   ``Handover`` record for every other member of the group;
2. round k's header (``ElasticRows.begin``) carries the record to them: holders re-address
   their ranges to the new master, the heir queues the adoption;
3. round k+1, before its engine steps, the heir adopts the request (``adopt``): a sequence
   with the prompt, every output so far (text and stop state rebuilt by replaying them, as a
   resumed request's are), the same seed and the text already reported, whose KV starts at the
   newest token; it decodes from this round on and streams the request's outputs.

A record is int64 words (the header's wire format): length, key, new master, KV tokens
(``n``), seed (-1: none), characters of text reported, the other holders, the rest of the
line, the output token ids.
"""

from __future__ import annotations

import msgspec

from tetris.engine.kv_shards import KVShard

__all__ = ["FormerMaster", "Handover", "adopt", "decode_records", "detach", "handover_of",
           "needs_block"]


class Handover(msgspec.Struct):
    key: int
    master: int                  # the new master
    num_kv: int                  # tokens with KV: the new master's ``kv_start``
    seed: int | None
    text_sent: int
    holders: list[int]           # the new master's holders (the old master among them)
    line: list[int]              # heirs after the new master, in order
    outputs: list[int]           # every output token so far; the last one has no KV yet

    def words(self) -> list[int]:
        body = [self.key, self.master, self.num_kv, -1 if self.seed is None else self.seed,
                self.text_sent, len(self.holders), *self.holders, len(self.line), *self.line,
                *self.outputs]
        return [len(body) + 1, *body]


def decode_records(words: list[int]) -> list[Handover]:
    """The records of one header, in the order sent."""
    records, i = [], 0
    while i < len(words):
        n = words[i]
        body, i = words[i + 1:i + n], i + n
        key, master, num_kv, seed, text_sent, h = body[:6]
        holders = body[6:6 + h]
        nl = body[6 + h]
        line = body[7 + h:7 + h + nl]
        records.append(Handover(key, master, num_kv, None if seed < 0 else seed, text_sent,
                                holders, line, body[7 + h + nl:]))
    return records


class FormerMaster(KVShard):
    """The old master's range: the sequence's blocks, still owned under the request's name in
    the engine's block manager (so ``ShardHolder.free`` returns them to the same owner)."""

    @property
    def request_id(self) -> str:
        return self.request


def needs_block(seq, block_size: int) -> bool:
    """Whether the sequence's next token starts a new block (block_manager's rule)."""
    return seq.num_tokens - seq.kv_start > len(seq.block_table) * block_size


def detach(engine, request_id: str, index: int) -> tuple[FormerMaster, object]:
    """Take a decoding request's sequence out of ``engine`` keeping its blocks: returns its
    range ``[kv_start, n)`` (n tokens with KV) as a shard held on instance ``index``, and the
    sequence (its state goes into the ``Handover``)."""
    seq = engine._seqs.pop(request_id)
    table, seq.block_table = seq.block_table, []
    engine.batcher.remove(seq)   # frees nothing: the table went to the shard
    shard = FormerMaster(request_id, index, seq.kv_start)
    shard.num_tokens = seq.num_computed - seq.kv_start
    shard.block_table = table
    return shard, seq


def handover_of(seq, key: int, heir: int, holders: list[int], line: list[int]) -> Handover:
    return Handover(key, heir, seq.num_computed, seq.seed, seq.text_sent, holders, line,
                    list(seq.output_token_ids))


def adopt(engine, request_id: str, prompt, params, record: Handover) -> None:
    """Make ``engine`` the request's master from ``record.num_kv`` on: its newest output token
    is the next step's input. Raises ``OutOfBlocksError`` without a free block."""
    engine.reserve_blocks(request_id, prompt, params, record.outputs, kv_start=record.num_kv)
    seq = engine._seqs[request_id]
    # replaying the outputs rebuilt the text; what the old master already reported is not
    # sent again, and sampled draws go on with the same (seed, position) keys
    seq.text_sent = record.text_sent
    seq.seed = record.seed
    seq.num_computed = record.num_kv
    engine.batcher.add_prefilled(seq)
