"""``LLMEngine``: one model instance serving many requests with continuous batching.

The unit that decode actors wrap and the reference that distributed execution must match.
One ``step()`` is: the batcher plans the iteration (decodes, prefill chunks, admissions,
preemptions), the model runner executes it against the paged KV cache, the sampler draws one
token for every sequence whose tokens are all computed, and stop conditions finish sequences
and free their blocks. Requests added between steps join at the next step.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence as Seq

import msgspec

from tetris.engine.batcher import Batcher
from tetris.engine.block_manager import BlockManager, OutOfBlocksError
from tetris.engine.kv_cache import KVCache
from tetris.engine.model_runner import ModelRunner
from tetris.engine.request import (
    FinishReason,
    RequestOutput,
    Sequence,
    SequenceStatus,
    TokenLogprob,
)
from tetris.engine.sampling import check_stop, sample
from tetris.sampling_params import SamplingParams
from tetris.token_ids import compact_tokens

__all__ = ["LLMEngine", "EngineStats"]


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot of one engine's load; ``free_blocks * block_size`` is its free KV slots."""

    running: int
    waiting: int
    ready: int
    receiving: int
    free_blocks: int
    total_blocks: int
    block_size: int
    preemptions: int  # by the requests now unfinished


class LLMEngine:
    """Serve ``model`` (a ``LlamaModel``) with a paged cache of ``num_blocks`` x ``block_size``.

    ``tokenizer`` is optional: without it outputs carry token ids only and stop strings are
    refused. ``seed`` seeds the choice of seed for requests that bring none of their own.
    ``cuda_graphs`` (None: on iff the model is on CUDA) replays captured decode steps for the
    batch sizes ``graph_batch_sizes`` (default: 1, 2, 4, 8, multiples of 16 up to
    ``max_num_seqs``); it holds one KV block back as the padding rows' scratch space. True
    off CUDA runs the same padded path eagerly (for tests). ``packed_weights`` (None: on iff
    the model is on CPU) gives the model's GEMM weights oneDNN-packed copies
    (``LlamaModel.pack_weights``): the same fp32 math, faster on CPU, twice the weight memory.
    """

    def __init__(self, model, tokenizer=None, *, num_blocks: int = 1024, block_size: int = 16,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 2048,
                 seed: int | None = 0, cuda_graphs: bool | None = None,
                 graph_batch_sizes: Seq[int] | None = None,
                 packed_weights: bool | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = model.cfg.max_position_embeddings
        self.vocab_size = model.cfg.vocab_size
        self.blocks = BlockManager(num_blocks, block_size)
        self.cache = KVCache.for_model(model, num_blocks, block_size)
        self.batcher = Batcher(self.blocks, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens)
        if cuda_graphs is None:
            cuda_graphs = self.cache.buffer.device.type == "cuda"
        graph_kw = {}
        self._usable_blocks = num_blocks
        if cuda_graphs:
            scratch = self.blocks.reserve("<cuda-graph-scratch>")
            self._usable_blocks -= 1
            longest = min(self.max_model_len + 1, self._usable_blocks * block_size)
            graph_kw = dict(scratch_slot=scratch * block_size,
                            max_blocks_per_seq=self.blocks.blocks_needed(longest),
                            graph_batch_sizes=list(graph_batch_sizes or []) or None,
                            max_batch_size=max_num_seqs)
        if packed_weights is None:  # on CPU, for models that can pack
            packed_weights = (self.cache.buffer.device.type == "cpu"
                              and hasattr(model, "pack_weights"))
        if packed_weights:
            model.pack_weights(batch_hint=max_num_seqs)
        self.runner = ModelRunner(model, self.cache, cuda_graphs=cuda_graphs, **graph_kw)
        self._rng = random.Random(seed)
        self._seqs: dict[str, Sequence] = {}
        # Outputs produced between steps (aborts, prefilled first tokens), sent by the next.
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        eos = tokenizer.eos_token_ids if tokenizer is not None else model.cfg.eos_token_ids
        self._eos = frozenset(eos)

    @classmethod
    def from_deployment(cls, deployment, **overrides) -> LLMEngine:
        """Load the deployment's model; cache and batch sizes from its ``[decode]`` table."""
        from tetris.model.loader import load_model

        model, tokenizer = load_model(deployment.model)
        kw = dict(num_blocks=deployment.decode.kv_blocks, block_size=deployment.decode.block_size,
                  max_num_seqs=deployment.decode.max_batch_size)
        kw.update(overrides)
        return cls(model, tokenizer, **kw)

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int],
                    params: SamplingParams) -> None:
        """Queue a request; raises ``ValueError`` for input it can never serve."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        self._seqs[request_id] = seq
        self.batcher.add(seq)

    def _new_sequence(self, request_id: str, prompt_token_ids: Seq[int],
                      params: SamplingParams, kv_start: int = 0) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already running")
        try:
            prompt = compact_tokens(prompt_token_ids)   # one int32 buffer (request.Tokens)
        except ValueError as e:
            raise ValueError(f"prompt token ids must be integers in the vocabulary "
                             f"[0, {self.vocab_size}): {e}") from None
        self._validate_prompt(prompt, kv_start)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        seed = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                       else self._eos)
        # A sequence never outgrows the whole cache, so one that runs alone always fits (an
        # elastic master holds positions from kv_start on: engine/elastic_rows.py).
        max_total = min(self.max_model_len,
                        kv_start + self._usable_blocks * self.blocks.block_size)
        return Sequence(request_id, prompt, params, seed=seed, stop_token_ids=stop_ids,
                        max_total_tokens=max_total)

    def _validate_prompt(self, prompt: Seq[int], kv_start: int = 0) -> None:
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(prompt) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens but the model's context is "
                f"{self.max_model_len} tokens (max_position_embeddings)"
            )
        if not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        capacity = self._usable_blocks * self.blocks.block_size
        if self.blocks.blocks_needed(len(prompt) - kv_start + 1) > self._usable_blocks:
            at = f" ({len(prompt) - kv_start} from position {kv_start} on)" if kv_start else ""
            raise ValueError(
                f"prompt has {len(prompt)} tokens{at} but the KV cache holds only {capacity} tokens"
            )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes from the next step."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.batcher.remove(seq)
        seq.finish(FinishReason.ABORT)
        self._pending.append(seq.to_output(()))
        return True

    # -- disaggregated prefill: the prompt's KV comes from a prefill instance ---------------

    def can_reserve(self, num_prompt_tokens: int, shared: int = 0) -> bool:
        """Whether blocks for a prefilled prompt of this length are free now (its first
        ``shared`` blocks shared with a kept run need none: engine/kept_kv.py)."""
        return self.blocks.can_allocate(num_prompt_tokens + 1, shared)

    def reserve(self, request_id: str, prompt_token_ids: Seq[int],
                params: SamplingParams, generated: Seq[int] = ()) -> list[int]:
        """Hold KV blocks for a prompt computed elsewhere; returns each position's cache slot.

        Slot ``s`` of layer ``i`` is ``cache.k[i].view(-1, Hkv, D)[s]`` (likewise ``v``):
        write the prompt's K/V there (``write_kv`` takes the slots as a tensor), then call
        ``commit_prefilled``. Raises ``OutOfBlocksError`` without room: check ``can_reserve``.

        ``generated``: a request resumed after the instance that ran it was lost. These output
        tokens were already streamed to the client; their KV comes with the prompt's (slots
        for both are returned), they count towards ``max_tokens`` and stop strings, and the
        outputs go on from them (``_resume``).
        """
        table = self.reserve_blocks(request_id, prompt_token_ids, params, generated)
        bs = self.blocks.block_size
        n = len(prompt_token_ids) + len(generated)
        return [table[p // bs] * bs + p % bs for p in range(n)]

    def reserve_blocks(self, request_id: str, prompt_token_ids: Seq[int],
                       params: SamplingParams, generated: Seq[int] = (), *,
                       kv_start: int = 0, shared: Seq[int] = ()) -> list[int]:
        """``reserve`` returning the block table (block ids in position order) instead of a slot
        per position: a long prompt's slot list is ~36 bytes a token of short-lived ints.

        ``kv_start``: this engine is the master of a request whose positions before it are held
        by other decode instances (engine/elastic_rows.py): blocks for ``[kv_start, n)`` only,
        the table's first block holding position ``kv_start``.

        ``shared``: blocks a kept run holds the prompt's first positions in, put at the head of
        the table (engine/kept_kv.py: ``shared_blocks``, then ``copy_boundary``)."""
        if shared and kv_start:
            raise ValueError(f"{request_id}: a kept prefix cannot be shared from kv_start {kv_start}")
        seq = self._new_sequence(request_id, prompt_token_ids, params, kv_start)
        if generated:
            self._resume(seq, generated)
        if not 0 <= kv_start < seq.num_tokens:
            raise ValueError(f"{request_id}: kv_start {kv_start} outside [0, {seq.num_tokens})")
        seq.kv_start = kv_start
        if not self.can_reserve(seq.num_tokens - kv_start, len(shared)):
            raise OutOfBlocksError(
                f"{request_id}: {seq.num_tokens} prompt tokens need "
                f"{self.blocks.blocks_needed(seq.num_tokens - kv_start + 1) - len(shared)} "
                f"blocks, {self.blocks.num_free_blocks} free"
            )
        self.blocks.allocate(seq, shared)
        seq.status = SequenceStatus.RECEIVING
        self._seqs[request_id] = seq
        return list(seq.block_table)

    def _resume(self, seq: Sequence, generated: Seq[int]) -> None:
        """Put ``generated`` back as ``seq``'s output: the text and stop state are rebuilt by
        replaying each token as the step that made it did, so the text goes on exactly as
        before. The first output after ``commit_prefilled`` carries the whole text again
        (nothing was sent from this engine yet); the caller trims what its client has."""
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        for i, token in enumerate(generated):
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"resumed token {token} is outside the vocabulary")
            seq.tokens.append(token)
            if check_stop(seq, token, decode) is not None:
                raise ValueError(f"{seq.request_id}: the resumed output already ends the request "
                                 f"at its token {i + 1} of {len(generated)}")

    def commit_prefilled(self, request_id: str, first_token: int,
                         logprob: TokenLogprob | None = None) -> None:
        """The reserved prompt's KV is complete and the prefill side sampled ``first_token``
        (and computed its ``logprob`` when the request asked for logprobs).

        The request joins the running batch at the next step, whose outputs begin with that
        token (so a stream looks the same as for ``add_request``).
        """
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not SequenceStatus.RECEIVING:
            raise ValueError(f"request {request_id!r} is not reserved and awaiting its KV")
        if not 0 <= int(first_token) < self.vocab_size:
            raise ValueError(f"first token {first_token} is outside the vocabulary")
        if seq.params.logprobs is not None:
            if logprob is None or logprob.token_id != int(first_token):
                raise ValueError(f"request {request_id!r} asks for logprobs: its first token "
                                 f"{first_token} needs its own from the prefill")
            seq.pending_logprobs.append(logprob)
        seq.num_computed = seq.num_tokens
        seq.tokens.append(int(first_token))
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        reason = check_stop(seq, int(first_token), decode)
        if reason is None:
            self.batcher.add_prefilled(seq)
        else:
            seq.finish(reason)
            self.batcher.remove(seq)
            del self._seqs[request_id]
        self._pending.append(seq.to_output((int(first_token),)))

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._pending)

    # -- one iteration --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; one output per request that got a token, finished or aborted."""
        outputs, self._pending = self._pending, []
        plan = self.batcher.schedule()
        if plan.empty:
            if self.batcher.waiting and not self.batcher.running and not plan.preempted:
                head = self.batcher.waiting[0]
                raise RuntimeError(f"{head.request_id} cannot be scheduled on an idle engine")
            return outputs
        sampling, tokens = self._execute(plan)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        for seq, token in zip(sampling, tokens, strict=True):
            seq.tokens.append(token)
            reason = check_stop(seq, token, decode)
            if reason is not None:
                seq.finish(reason)
                self.batcher.remove(seq)
                del self._seqs[seq.request_id]
            outputs.append(seq.to_output((token,)))
        return outputs

    def _execute(self, plan) -> tuple[list[Sequence], list[int]]:
        """Run the plan's forward pass; the sequences that sample this step and their tokens.

        The one place the model runs: an emulated engine overrides only this.
        """
        logits, sampling = self.runner.execute(plan)
        for sched in plan.decodes + plan.prefills:
            sched.seq.num_computed += sched.num_new_tokens
        return sampling, (sample(logits, sampling) if sampling else [])

    def generate(self, prompts: Seq[Seq[int] | str],
                 params: SamplingParams | Seq[SamplingParams]) -> list[RequestOutput]:
        """Run ``prompts`` (token ids, or text with a tokenizer) to completion, in order.

        It drives ``step()`` itself: meant for offline use, not next to streaming callers
        (their requests progress too, but their outputs are not returned).
        """
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                if isinstance(prompt, str):
                    if self.tokenizer is None:
                        raise ValueError("text prompts need a tokenizer; pass token ids")
                    prompt = self.tokenizer.encode(prompt)
                request_id = f"generate-{next(self._ids)}"
                self.add_request(request_id, prompt, p)
                ids.append(request_id)
        except ValueError:
            for request_id in ids:  # all or nothing: no half-submitted batch left queued
                self.abort_request(request_id)
            self._pending = [o for o in self._pending if o.request_id not in ids]
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(final) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def stats(self) -> EngineStats:
        """Load figures for routing (SPEC §5: free slots and batch size) and metrics."""
        b = self.batcher
        return EngineStats(
            running=len(b.running), waiting=len(b.waiting), ready=len(b.ready),
            receiving=sum(s.status is SequenceStatus.RECEIVING for s in self._seqs.values()),
            free_blocks=self.blocks.num_free_blocks, total_blocks=self._usable_blocks,
            block_size=self.blocks.block_size,
            preemptions=sum(s.num_preemptions for s in self._seqs.values()),
        )
