"""The Executor interface of a prefill worker, with two bodies (ARCHITECTURE "two bodies").

``ModelExecutor`` runs the real model: per layer, cache balancing, ring attention over the
chunk's group, MLP. ``EmulatedExecutor`` runs no model: it waits as long as the latency profile
predicts for the chunk (SPEC §2, Eq. 1), so the live control plane can run at paper scale on one
machine. The worker actor and the pool drive both the same way; results of the emulated body
carry ``emulated=True`` and every number derived from them must say so.
"""

from __future__ import annotations

import time
from array import array
from typing import Protocol

import msgspec
import torch

from tetris.actors.decode.emulated import PLACEHOLDER_TOKEN, WIRE_HEAD_DIM, torch_dtype
from tetris.actors.prefill.balance import BALANCE_TAG_KIND, LayerBalancer
from tetris.actors.prefill.emulated_kv import EmulatedHoldings
from tetris.actors.prefill.group_attention import group_attention, message_tag
from tetris.actors.prefill.head_shards import head_split_problem
from tetris.actors.prefill.kv_store import PagedKVStore, ranges_tensor
from tetris.actors.prefill.messages import ChunkResult, ChunkTask
from tetris.actors.prefill.range_stream import (check_ranges, open_range_shards,
                                                stream_range_layer)
from tetris.actors.prefill.sptp import SpTpAttention
from tetris.actors.prefill.world import PeerLink
from tetris.actors.prefill.zigzag import normalize_ranges, ranges_len
from tetris.engine.logprobs import token_logprob
from tetris.sampling_params import SamplingParams

__all__ = ["Executor", "ModelExecutor", "EmulatedExecutor", "sample_first_token", "message_tag"]

class FaultInjected(RuntimeError):
    """Raised by a test hook to simulate a worker failing in the middle of a chunk."""


def sample_first_token(logits: torch.Tensor, params: SamplingParams | None,
                       prompt_tokens: int) -> int:
    """The first output token from the last prompt token's logits [V], as the engine samples
    it: a seeded draw is keyed by (seed, position ``prompt_tokens``) (engine/sampling.py).
    Penalties and ``min_tokens`` need the whole prompt, which no member holds: the serving
    layer refuses ``repetition_penalty`` and ``min_tokens`` on the cluster, and presence and
    frequency penalties count output tokens only, of which the first token has none."""
    if params is None or params.greedy:
        return int(logits.argmax().item())
    from tetris.engine.sampling import draw, process_logits

    return draw(process_logits(logits, params), params.seed, prompt_tokens)


class Executor(Protocol):
    emulated: bool

    def prepare(self, task: ChunkTask) -> None:
        """Check the task and reserve what it needs, without communicating."""

    def execute(self, task: ChunkTask, link: PeerLink | None = None) -> ChunkResult:
        """Run this member's share of the chunk (all members of the group run together),
        talking to the others over ``link`` (the chunk's world; default: the default group)."""

    def abort(self, request_id: str) -> None:
        """Free everything held for the request."""


class ModelExecutor:
    emulated = False

    def __init__(self, model, store: PagedKVStore) -> None:
        self.model = model
        self.store = store
        self.fault: tuple[str, int, int] | None = None   # (request_id, chunk, layer), tests only
        self.pump = None   # a started TransferPump over a SendManager once transfer is enabled

    def prepare(self, task: ChunkTask) -> None:
        me = task.instance
        incoming = normalize_ranges([p for m in task.moves if m.dst == me for p in m.positions])
        kept = _subtract(task.history[task.rank], incoming)
        if ranges_len(kept):
            self.store.slots(task.request_id, kept)   # KeyError if the history is not here
        if len(task.token_ids) != ranges_len(task.chunk_positions[task.rank]):
            raise ValueError(f"chunk {task.chunk_index}: token count does not match positions")
        if task.kv_receivers or task.kv_ranges:
            self._check_streaming(task)
        # head shards of this instance's heads (its TP slice; KV heads replicated past Hkv)
        if task.sp_layout in ("a2a", "sptp"):
            why = head_split_problem(len(task.group), self.model.local_num_heads,
                                     self.model.local_num_kv_heads)
            if why:
                raise ValueError(f"chunk {task.chunk_index}: {task.sp_layout}: {why}")
        self.store.reserve(task.request_id, normalize_ranges(
            list(task.chunk_positions[task.rank]) + list(incoming)))

    def _check_streaming(self, task: ChunkTask) -> None:
        # Checked here, before any member waits on another, so a bad task fails the chunk cleanly.
        if self.pump is None:
            raise RuntimeError(f"chunk {task.chunk_index} streams KV but transfer is not enabled "
                               f"on prefill instance {task.instance}")
        if task.kv_ranges:
            return check_ranges(task, self.model.local_num_kv_heads)
        hkv, n = self.model.local_num_kv_heads, len(task.kv_receivers)
        if hkv % n or len(set(task.kv_receivers)) != n:
            raise ValueError(f"{hkv} KV heads cannot be split over receivers {task.kv_receivers}")

    def execute(self, task: ChunkTask, link: PeerLink | None = None) -> ChunkResult:
        t0 = time.perf_counter()
        model, store, req = self.model, self.store, task.request_id
        mine = task.chunk_positions[task.rank]
        q_pos = ranges_tensor(mine)
        blocks = [normalize_ranges(list(h) + list(c))
                  for h, c in zip(task.history, task.chunk_positions)]
        ring = group_attention(task, blocks, link, model.num_layers)
        moves = task.moves if task.balance != "off" else ()
        balancer = LayerBalancer(store, req, task.instance, moves,
                                 message_tag(task.seq, BALANCE_TAG_KIND), task.timeout_s, link)
        overlap = task.balance == "overlap"
        if overlap:
            balancer.issue(0)   # runs during embedding and layer 0's projections
        hidden = model.embed(_token_tensor(task.token_ids))
        # A chunk shorter than 2s leaves some members without tokens: they still pass blocks
        # around the ring and take part in balancing, but compute nothing.
        idle = q_pos.numel() == 0
        # Only KV computed here is streamed: history that balancing moves in was streamed by the
        # member that computed it, so a prompt's shards cover each position exactly once.
        heads = [] if idle else self._open_shards(task)
        for i in range(model.num_layers):
            if idle:
                q = hidden.new_empty((0, model.local_num_heads, model.head_dim))
            else:
                q, k, v = model.layer_qkv(i, hidden, q_pos)
                store.write(req, i, mine, k, v)
                if heads:
                    self._stream_layer(task, i, k, v, heads)
            balancer.wait(i)
            self._maybe_fail(task, i)
            kb, vb = store.read(req, i, blocks[task.rank])
            sptp = isinstance(ring, SpTpAttention)   # SP-TP runs the whole attention block
            if sptp:
                attn_out = ring.attention_block(model, i, hidden, kb, vb)
            else:
                attn = ring(q, q_pos, kb, vb, layer=i)
            if overlap:
                balancer.issue(i + 1)   # hidden behind this layer's o_proj and MLP (Fig. 6-b)
            if not idle:
                hidden = model.layer_mlp(i, attn_out if sptp
                                         else model.layer_attn_out(i, hidden, attn))
        sent = normalize_ranges([p for m in balancer.sends for p in m.positions])
        store.release(req, sent)
        token, logits, logprob = self._first_token(task, hidden, q_pos)
        # by ranges, the master starts once every holder has its range (elastic_pool.commit)
        streamed = (token is not None and bool(heads) and not task.kv_ranges
                    and stream_first_token(self.pump, task, token, logprob))
        return ChunkResult(
            request_id=req, chunk_index=task.chunk_index, instance=task.instance,
            rank=task.rank, elapsed_s=time.perf_counter() - t0,
            balance_wait_s=balancer.wait_s, balance_sent_tokens=balancer.sent_tokens,
            balance_recv_tokens=balancer.recv_tokens, first_token=token, logits=logits,
            first_logprob=logprob, first_token_streamed=streamed,
            sent_elements=getattr(ring, "sent_elements", 0),
        )

    def _open_shards(self, task: ChunkTask) -> list[tuple[int, slice]]:
        """One shard per receiver over this member's zigzag share; (receiver, head slice) pairs."""
        if task.kv_ranges:
            return open_range_shards(self.pump, self.model, task)
        if not task.kv_receivers:
            return []
        model = self.model
        h = model.local_num_kv_heads // len(task.kv_receivers)
        now = time.monotonic()
        with self.pump.locked() as mgr:
            for r in task.kv_receivers:
                mgr.add_shard(request_id=task.request_id, chunk_index=task.chunk_index, receiver_id=r,
                              prompt_tokens=task.prompt_tokens, chunk=(task.chunk_start, task.chunk_end),
                              ranges=task.chunk_positions[task.rank], num_layers=model.num_layers,
                              kv_heads=h, head_dim=model.head_dim, dtype=model.dtype, now=now)
        return [(r, slice(j * h, (j + 1) * h)) for j, r in enumerate(task.kv_receivers)]

    def _stream_layer(self, task: ChunkTask, layer: int, k, v, heads) -> None:
        """k, v [n, Hkv, D] of this member's share -> per receiver a fresh [n, 2, h, D] tensor."""
        if task.kv_ranges:
            return stream_range_layer(self.pump, task, layer, k, v, heads)
        parts = [(r, torch.stack((k[:, hs], v[:, hs]), dim=1)) for r, hs in heads]
        with self.pump.locked() as mgr:
            for r, kv in parts:
                mgr.layer_ready(task.request_id, task.chunk_index, layer, kv, receiver_id=r)

    def _first_token(self, task: ChunkTask, hidden, q_pos):
        last = task.prompt_tokens - 1
        if task.chunk_index != task.num_chunks - 1 or not bool((q_pos == last).any()):
            return None, None, None
        idx = int((q_pos == last).nonzero()[0, 0])
        logits = self.model.logits(self.model.final_norm(hidden[idx: idx + 1]))[0]
        token = sample_first_token(logits, task.sampling, task.prompt_tokens)
        logprob = None
        if task.sampling is not None and task.sampling.logprobs is not None:
            # from the raw logits, as the decode engine reads its tokens' (engine/logprobs.py)
            logprob = token_logprob(logits, token, task.sampling.logprobs)
        return token, (logits.tolist() if task.return_logits else None), logprob

    def _maybe_fail(self, task: ChunkTask, layer: int) -> None:
        if self.fault == (task.request_id, task.chunk_index, layer):
            self.fault = None
            raise FaultInjected(f"injected fault at layer {layer}")

    def abort(self, request_id: str) -> None:
        self.store.free(request_id)


class EmulatedExecutor:
    """Waits the profile's predicted chunk time: ``T_s(h, l)`` of SPEC §2 (paper Eq. 1).

    EMULATION. With a pump (``enable_transfer``) and ``kv_receivers`` it streams like the real
    body: a handshake per receiver at the start, then ``layer_ready`` per layer at
    ``(i + 1) · T / L`` with KV of the wire geometry (``head_dim`` 1, zeros), so the transfer
    control plane runs for real while the emulated backend times the paper's bytes. The member
    holding the prompt's last token returns ``PLACEHOLDER_TOKEN`` as the first token.
    ``holdings`` keeps the positions a real store would hold (``emulated_kv.py``), so a plan
    from a cached prefix finds its copies and ``held_requests`` shows what is kept.
    """

    emulated = True

    def __init__(self, profile, model=None, *, tp_size: int = 1,
                 sleep=time.sleep, clock=time.perf_counter) -> None:
        self.profile = profile
        self.model = model          # ModelConfig: geometry of streamed KV (None: no streaming)
        self.tp_size = tp_size
        self.sleep = sleep
        self.clock = clock
        self.fault: tuple[str, int, int] | None = None
        self.pump = None            # a started TransferPump once transfer is enabled
        self.holdings = EmulatedHoldings()

    def prepare(self, task: ChunkTask) -> None:
        if task.chunk_end <= task.chunk_start:
            raise ValueError(f"chunk {task.chunk_index} is empty")
        me = task.instance
        incoming = [p for m in task.moves if m.dst == me for p in m.positions]
        if task.kv_ranges:
            raise ValueError("per-range KV streaming (elastic decode) is not emulated")
        if task.kv_receivers:
            if self.pump is None or self.model is None:
                raise RuntimeError(f"chunk {task.chunk_index} streams KV but transfer is not "
                                   f"enabled on emulated prefill instance {task.instance}")
            hkv, n = self.model.num_kv_heads // self.tp_size, len(task.kv_receivers)
            if hkv % n or len(set(task.kv_receivers)) != n:
                raise ValueError(f"{hkv} KV heads cannot be split over receivers {task.kv_receivers}")
        self.holdings.reserve(task.request_id, list(task.chunk_positions[task.rank]) + incoming)

    def execute(self, task: ChunkTask, link: PeerLink | None = None) -> ChunkResult:
        t0 = self.clock()   # the emulated body talks to no peer: ``link`` is unused
        if self.fault is not None and self.fault[:2] == (task.request_id, task.chunk_index):
            self.fault = None
            raise FaultInjected("injected fault (emulated)")
        seconds = float(self.profile.predict(len(task.group), task.chunk_start,
                                             task.chunk_end - task.chunk_start))
        # as the simulator runs it: Eq. 1 + the layout's (or the ring's pieces') delta
        if task.sp_layout != "ring" or task.sp_micro_partitions > 1 or task.sp_layout_delta_s:
            seconds += task.sp_layout_delta_s
        seconds = max(0.0, seconds)
        mine = task.chunk_positions[task.rank]
        wire = self._open_shards(task) if task.kv_receivers and ranges_len(mine) else []
        if wire:
            layers = self.model.num_layers
            for i in range(layers):
                # Absolute deadlines: the sleeps' overshoot does not add up over the layers.
                self.sleep(max(0.0, t0 + seconds * (i + 1) / layers - self.clock()))
                with self.pump.locked() as mgr:
                    for r, kv in wire:
                        mgr.layer_ready(task.request_id, task.chunk_index, i, kv, receiver_id=r)
        else:
            self.sleep(max(0.0, t0 + seconds - self.clock()))
        last = task.prompt_tokens - 1
        holds_last = task.chunk_index == task.num_chunks - 1 and any(
            lo <= last < hi for lo, hi in mine)
        streamed = holds_last and bool(wire) and stream_first_token(
            self.pump, task, PLACEHOLDER_TOKEN, None)
        if task.balance != "off":   # as the real body: history sent away is freed here
            self.holdings.release(task.request_id, [
                p for m in task.moves if m.src == task.instance for p in m.positions])
        return ChunkResult(
            request_id=task.request_id, chunk_index=task.chunk_index, instance=task.instance,
            rank=task.rank, elapsed_s=self.clock() - t0, emulated=True,
            first_token=PLACEHOLDER_TOKEN if holds_last else None, first_token_streamed=streamed,
        )

    def _open_shards(self, task: ChunkTask) -> list[tuple[int, torch.Tensor]]:
        """Handshake each receiver; per receiver the zero KV ``[n, 2, h, WIRE_HEAD_DIM]`` that
        every layer sends (never written, so one tensor serves all layers)."""
        n_recv = len(task.kv_receivers)
        h = self.model.num_kv_heads // self.tp_size // n_recv
        dtype = torch_dtype(self.model.dtype)
        mine = task.chunk_positions[task.rank]
        n = ranges_len(mine)
        now = time.monotonic()
        with self.pump.locked() as mgr:
            for r in task.kv_receivers:
                mgr.add_shard(request_id=task.request_id, chunk_index=task.chunk_index, receiver_id=r,
                              prompt_tokens=task.prompt_tokens, chunk=(task.chunk_start, task.chunk_end),
                              ranges=mine, num_layers=self.model.num_layers, kv_heads=h,
                              head_dim=WIRE_HEAD_DIM, dtype=dtype, now=now)
        return [(r, torch.zeros((n, 2, h, WIRE_HEAD_DIM), dtype=dtype)) for r in task.kv_receivers]

    def stream_prefix(self, request_id: str, ranges, prompt_tokens: int, upto: int,
                      receivers: tuple[int, ...]) -> None:
        """``prefix.stream_prefix`` with zero KV of the wire geometry: one ``PREFIX_CHUNK``
        shard per receiver, every layer ready at once (the emulated link times its bytes)."""
        from tetris.actors.prefill.prefix import PREFIX_CHUNK

        h = self.model.num_kv_heads // self.tp_size // len(receivers)
        dtype = torch_dtype(self.model.dtype)
        kv = torch.zeros((ranges_len(ranges), 2, h, WIRE_HEAD_DIM), dtype=dtype)
        now = time.monotonic()
        with self.pump.locked() as mgr:
            for r in receivers:
                mgr.add_shard(request_id=request_id, chunk_index=PREFIX_CHUNK, receiver_id=r,
                              prompt_tokens=prompt_tokens, chunk=(0, upto), ranges=ranges,
                              num_layers=self.model.num_layers, kv_heads=h,
                              head_dim=WIRE_HEAD_DIM, dtype=dtype, now=now)
            for layer in range(self.model.num_layers):
                for r in receivers:
                    mgr.layer_ready(request_id, PREFIX_CHUNK, layer, kv, receiver_id=r)

    def abort(self, request_id: str) -> None:
        self.holdings.free(request_id)


def stream_first_token(pump, task: ChunkTask, token: int, logprob) -> bool:
    """Send the first token to the request's decode ranks after this member's KV handshakes
    (transfer ``FirstToken``), so decoding starts without a hop through the dispatcher."""
    data = b"" if logprob is None else msgspec.msgpack.encode(logprob)
    with pump.locked() as mgr:
        mgr.first_token(task.request_id, task.kv_receivers, int(token), data)
    return True


def _token_tensor(token_ids) -> torch.Tensor:
    """[n] int64 ids for the embedding; an int32 ``array('i')`` is read as one buffer."""
    if isinstance(token_ids, array) and len(token_ids):
        return torch.frombuffer(token_ids, dtype=torch.int32).long()
    return torch.tensor(list(token_ids), dtype=torch.long)


def _subtract(a, b):
    """Positions of ranges ``a`` not in ranges ``b`` (both normalized)."""
    if not b:
        return a
    drop = set(p for lo, hi in b for p in range(lo, hi))
    keep = [p for lo, hi in a for p in range(lo, hi) if p not in drop]
    out: list[tuple[int, int]] = []
    for p in keep:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return tuple(out)
