"""EMULATION: one KunServe decode unit (an instance, or a group run as a pipeline).

``PipelinedEmulatedEngine`` is an ``EmulatedDecodeEngine`` (no model, no KV tensors; the
engine's own ``Batcher`` and ``BlockManager`` do admission, paged growth and preemption by
recompute) whose step sleeps the time a caller-given model assigns to the contexts of the
sequences it runs: for KunServe the simulator's ``unit_time`` (a group's pipelined round over
its lookahead micro-batches), so emulated and simulated units share one timing model. A group is one
engine whose block manager holds the group's capacity (one block table serves every member,
docs/kunserve.md); recomputed prompts (a preempted sequence re-admitted) add their prefill.

``take`` and ``give`` move a decoding sequence between units with its blocks' worth of KV
(the drop's and the restore's KV exchange): nothing is recomputed, ``give`` holds it out of
the batch until its exchange has finished (``ready_at``).

Thread use: the driver holds one lock around every call; ``step`` releases it (``lock``)
while it sleeps, so reservations and commits go on during an iteration, as on a GPU.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable

from tetris.engine.batcher import Batcher
from tetris.engine.block_manager import BlockManager
from tetris.engine.request import Sequence, SequenceStatus

from .emulated import PLACEHOLDER_TOKEN, EmulatedDecodeEngine

__all__ = ["PipelinedEmulatedEngine", "StepModel"]

StepModel = Callable[[list[int]], float]   # (each scheduled sequence's tokens) -> seconds


class PipelinedEmulatedEngine(EmulatedDecodeEngine):
    def __init__(self, members: tuple[int, ...], *, num_blocks: int, block_size: int,
                 max_batch: int, step_model: StepModel, prefill_s_per_token: float,
                 time_scale: float = 1.0, lock: threading.Lock | None = None,
                 vocab_size: int = 256, max_model_len: int = 1 << 20) -> None:
        # EmulatedDecodeEngine.__init__ reads a DeploymentConfig; a unit is given its sizes.
        self.members = members
        self.step_model = step_model
        self.prefill_s_per_token = prefill_s_per_token
        self.time_scale = time_scale
        self.sleep = time.sleep
        self.lock = lock
        self.model = self.runner = self.tokenizer = None
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.blocks = BlockManager(num_blocks, block_size)
        self._usable_blocks = num_blocks
        self.batcher = Batcher(self.blocks, max_num_seqs=max_batch * len(members),
                               max_num_batched_tokens=num_blocks * block_size)
        self.cache = None
        self._rng = random.Random(0)
        self._seqs: dict[str, Sequence] = {}
        self._pending = []
        self._ids = itertools.count()
        self._eos = frozenset()
        self.emulated_s = 0.0
        self.steps = 0
        self._step_start = self._step_end = self._last_seconds = 0.0
        self.continuing = False
        self.max_lag = 0.0       # wall seconds the thread ran behind the unit's timeline
        self.held: list[tuple[float, Sequence]] = []    # arriving by KV exchange
        self.pending_s = 0.0     # transfers the next iteration waits for (swap over PCIe)

    def step_seconds(self, plan) -> float:
        scheduled = plan.decodes + plan.prefills
        contexts = [s.seq.num_tokens for s in scheduled]
        recompute = sum(s.num_new_tokens for s in plan.prefills)
        return (self.step_model(contexts)
                + recompute * self.prefill_s_per_token + self.pending_s) * self.time_scale

    def step(self):
        # Back to back (``continuing``: the driver had no idle wait since the last step), an
        # iteration begins where the last one ended, however late this thread got here: the
        # unit's iterations form one timeline, as on a GPU, and the model's time includes the
        # step's CPU work (``per_seq_s``). After an idle gap, it begins now.
        now = time.monotonic()
        if self.continuing and self._step_end:
            # How far this thread runs behind its own timeline: a few ms of bookkeeping on a
            # machine that keeps up; growing without bound on one that cannot (the run then
            # measures the machine, and its results should not be quoted).
            self.max_lag = max(self.max_lag, now - self._step_end)
        self._step_start = self._step_end if self.continuing and self._step_end else now
        return super().step()

    @property
    def step_end(self) -> float:
        """When the last iteration ends on the unit's timeline (``time.monotonic`` seconds)."""
        return self._step_end

    def _execute(self, plan) -> tuple[list[Sequence], list[int]]:
        """Sleep until the iteration's model time after it began."""
        seconds = self.step_seconds(plan)
        self._step_end = self._step_start + seconds
        self._last_seconds = seconds
        if self.lock is not None:       # the iteration runs "on the GPU": others may go on
            self.lock.release()
        try:
            self.sleep(max(0.0, self._step_end - time.monotonic()))
        finally:
            if self.lock is not None:
                self.lock.acquire()
        self.emulated_s += seconds
        self.pending_s = 0.0
        self.steps += 1
        scheduled = plan.decodes + plan.prefills
        sampling = [s.seq for s in scheduled if s.samples]
        for sched in scheduled:
            sched.seq.num_computed += sched.num_new_tokens
        return sampling, [PLACEHOLDER_TOKEN] * len(sampling)

    # -- KV exchange between units ------------------------------------------------------------
    def take(self) -> list[tuple[Sequence, int]]:
        """Every unfinished sequence leaves this unit with its state, and the blocks it held
        here (its KV to exchange), which are freed."""
        seqs = [*self.batcher.running, *self.batcher.ready, *self.batcher.waiting,
                *(s for _, s in self.held)]
        listed = {id(s) for s in seqs}
        seqs += [s for s in self._seqs.values() if id(s) not in listed]   # prompts in prefill
        out = []
        for seq in seqs:
            out.append((seq, len(seq.block_table)))
            self.batcher.remove(seq)
            self._seqs.pop(seq.request_id, None)
        self.held = []
        return out

    def give(self, seq: Sequence, ready_at: float) -> None:
        """Place ``seq`` here; a decoding one joins the batch at ``ready_at`` (its KV
        exchange), a preempted one waits for re-admission (its KV is recomputed anyway)."""
        self._seqs[seq.request_id] = seq
        if seq.status is SequenceStatus.RECEIVING and seq.num_computed == 0:
            self.blocks.allocate(seq)                  # in prefill: its prompt's KV lands here
        elif seq.num_computed == 0:
            self.batcher.waiting.append(seq)
        else:
            self.blocks.allocate(seq)
            self.held.append((ready_at, seq))

    def release_held(self, now: float) -> float | None:
        """Sequences whose exchange is over join the batch; the next ``ready_at``, if any."""
        keep = []
        for ready_at, seq in self.held:
            if ready_at <= now:
                self.batcher.add_prefilled(seq)
            else:
                keep.append((ready_at, seq))
        self.held = keep
        return min((t for t, _ in keep), default=None)
