"""Iteration-level batching: which sequences run this step, and how many tokens each.

Every running sequence is scheduled with its uncomputed tokens: one for a decoding sequence,
its (rest of the) prompt for a new one. One step of the model runs them all together, so a new
request joins the running decodes at the next step. Policy, in order:

0. Sequences prefilled on other instances (disaggregation) take free seats first.
1. Decodes first, in admission order, one token each. A decode that needs a new KV block when
   none is free preempts the most recently admitted running sequence (possibly itself): its
   blocks are freed and it returns to the front of the queue, to be recomputed (prompt plus
   the tokens it had generated) when blocks free up. Oldest requests thus always progress.
2. Sequences part way through their prompt continue it (chunked prefill).
3. Waiting sequences are admitted first-come first-served while the batch has a seat
   (``max_num_seqs``), the step has token budget (``max_num_batched_tokens``) and the cache
   has blocks for all their tokens, and only in steps that preempted nothing. A prompt longer
   than the remaining budget is computed in chunks over several steps. The queue head is never
   skipped, so no request starves.
"""

from __future__ import annotations

from collections import deque

import msgspec

from tetris.engine.block_manager import BlockManager, OutOfBlocksError
from tetris.engine.request import Sequence, SequenceStatus

__all__ = ["Batcher", "BatchPlan", "ScheduledSeq"]


class ScheduledSeq(msgspec.Struct):
    """``num_new_tokens`` of ``seq``'s tokens, from position ``seq.num_computed``, run this step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token (so a new one is drawn)."""
        return self.seq.num_computed + self.num_new_tokens == self.seq.num_tokens


class BatchPlan(msgspec.Struct):
    """One step's work: decodes (one token each) first, then prefill chunks."""

    decodes: list[ScheduledSeq]
    prefills: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.prefills)


class Batcher:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Prefilled elsewhere (KV already in their blocks): they take free seats before any
        # waiting prompt, since their prefill is already paid for.
        self.ready: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """Queue a sequence that holds blocks with its prompt's KV and its first token."""
        if not seq.block_table or seq.num_uncomputed != 1:
            raise ValueError(f"{seq.request_id}: not prefilled (needs blocks and one new token)")
        self.ready.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.ready:
            self.ready.remove(seq)
        self.blocks.free(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.ready)

    def schedule(self) -> BatchPlan:
        plan = BatchPlan(decodes=[], prefills=[], preempted=[])
        while self.ready and len(self.running) < self.max_num_seqs:
            seq = self.ready.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        budget = self.max_num_batched_tokens - self._schedule_decodes(plan)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_uncomputed > 1 or seq.num_computed == 0:
                n = min(seq.num_uncomputed, budget)
                plan.prefills.append(ScheduledSeq(seq, n))
                budget -= n
        if not plan.preempted:  # re-admitting in the step that preempted would only thrash
            self._admit(plan, budget)
        return plan

    def _schedule_decodes(self, plan: BatchPlan) -> int:
        """Schedule every decoding sequence, preempting the newest ones when blocks run out."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.num_uncomputed != 1 or seq.num_computed == 0:
                i += 1
                continue
            # kept runs (engine/kept_kv.py) yield their blocks before a request is preempted
            while not self.blocks.can_append(seq) and not self.blocks.make_room(1):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.blocks.append_slot(seq)
                plan.decodes.append(ScheduledSeq(seq, 1))
                i += 1
        return len(plan.decodes)

    def _admit(self, plan: BatchPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # One spare slot so that the first decode after the prompt can always be written.
            if not self.blocks.can_allocate(seq.num_tokens + 1) and not self.blocks.make_room(
                    self.blocks.blocks_needed(seq.num_tokens + 1)):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens, budget)
            plan.prefills.append(ScheduledSeq(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence, plan: BatchPlan) -> None:
        # Victims come from the end of ``running``, past every decode already placed in the
        # plan, so the plan never holds a sequence that lost its blocks.
        if seq.kv_start:  # its earlier KV is on other instances: no recompute here
            raise OutOfBlocksError(f"{seq.request_id}: a sharded request's master cannot be "
                                   "preempted (its placement keeps room for its output)")
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
