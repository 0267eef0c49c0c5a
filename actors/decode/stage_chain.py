"""A served KunServe member's steps as a chain of hops through the group (issue #24, §4.2).

Member j of a g-member group holds layers ``ranges[j]`` (member order is layer order). The
member whose batch it is (the *owner*) embeds its tokens and sends the hidden states [T, H]
to the member holding layer 0 (or runs them itself if that is it); each member runs its
layers on what arrives (on its link's reader thread) and forwards the result to the next
member; the one holding the last layers sends the final hidden states back to the owner,
which applies the final norm and samples (``PipelineRunner.execute``). Hops per micro-batch:
g when the owner is the first or the last member (0 -> 1 -> ... -> g-1 -> 0), g + 1 for one
in the middle (owner -> 0 -> ... -> owner -> ... -> g-1 -> owner, its own layers run when
the chain passes it); a star (a round trip to each other member) takes 2 (g - 1). Every hop
is an ``ACTIVATION`` item: ahead of bulk KV on the same link (``transfer/traffic.py``).

With a ``MemberLookahead`` a decode step's batch is cut into micro-batches of equal predicted
cost (``tetris/scheduler/member_lookahead.py``), all started at once, so that the next
member runs one while this one runs the next; the peers' load comes from the chains that pass
through this member (every chain passes every member). The logits are the same: a decode
row's computation does not depend on the other rows.

Failure: the owner waits for its micro-batches until ``step_timeout_s`` at most, then fails
the step (a member that hangs without closing its sockets). Sooner when anything breaks:
a member whose stage fails, or whose forward cannot be sent, answers the owner with the
error; a member whose link to a peer broke (that peer died) fails its own steps at once and
tells every other member (``member_lost``), whose steps then fail too. A failed step breaks
the instance and its requests take the dispatcher's resume path.

Lifecycle: 1. ``ChainRunner(...)`` by ``GroupMember.drop``; 2. the engine's steps call
``execute`` -> ``run_stages``; 3. the member's link threads call ``on_chain`` /
``on_result`` / ``fail``; 4. the runner is dropped at restore.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import msgspec
import torch
from tetris.actors.decode.group_links import GroupLinks
from tetris.kernels.paged_decode import decode_meta
from tetris.transfer.traffic import TrafficClass

from tetris.engine.model_runner import BatchInputs, _torch_decode_path
from tetris.engine.pipeline import PipelineRunner, Stage
from tetris.scheduler.lookahead import Chunk
from tetris.scheduler.member_lookahead import MemberLookahead, micro_batch_rows

__all__ = ["ChainRunner", "RemoteStage"]


class RemoteStage:
    """Layers ``[start, end)`` held by member ``member``: a place in the chain. Quacks as
    ``Stage`` for ``PipelineRunner`` (``model``, ``cache`` and ``runner`` are the local
    stage's: same block geometry); never run here."""

    def __init__(self, member: int, start: int, end: int, local: Stage):
        self.member, self.start, self.end = member, start, end
        self.model, self.cache, self.runner = local.model, local.cache, local.runner

    def run(self, *args):
        raise RuntimeError(f"member {self.member}'s layers run on member {self.member}")


def _meta(stage: Stage, inputs: BatchInputs, decode_only: bool):
    """The torch decode kernel's per-step tensors, as ``ModelRunner`` builds them."""
    if not decode_only or not _torch_decode_path(stage.cache.buffer.device):
        return None
    return decode_meta(inputs.block_tables, inputs.context_lens, stage.cache.block_size,
                       stage.cache.num_blocks, int(inputs.context_lens.max()))


def _rows(inputs: BatchInputs, lo: int, hi: int) -> BatchInputs:
    """Decode rows ``[lo, hi)`` as a batch of their own, copied (a pickled view would carry
    its whole storage), without engine objects."""
    return msgspec.structs.replace(
        inputs, input_ids=inputs.input_ids[lo:hi].clone(),
        positions=inputs.positions[lo:hi].clone(), slot_mapping=inputs.slot_mapping[lo:hi].clone(),
        num_decodes=hi - lo, block_tables=inputs.block_tables[lo:hi].clone(),
        context_lens=inputs.context_lens[lo:hi].clone(),
        sample_rows=torch.arange(hi - lo, dtype=torch.int64), sample_seqs=[])


class ChainRunner(PipelineRunner):
    def __init__(self, member: int, stages: list, links: GroupLinks, *,
                 step_timeout_s: float, lookahead: MemberLookahead | None = None) -> None:
        super().__init__(stages)
        self.member, self.links = member, links
        self.local: Stage = stages[member]
        self.step_timeout_s = step_timeout_s
        self.lookahead = lookahead
        self.stage_runs = 0           # other members' micro-batches run here
        self.micro_batches = 0        # micro-batches this member started
        # False: one micro-batch in the chain at a time (the same micro-batches without their
        # overlap: what benchmarks/bench_kunserve_lookahead.py compares the overlap against)
        self.overlap = True
        self._ids = itertools.count(1)
        self._pending: dict[int, queue.Queue] = {}
        self._broken: str | None = None
        self._lock = threading.Lock()
        self._peer_load: dict[int, tuple[int, float, float, float]] = {}  # step, cost, t, dt
        self._last_step_s = 0.0

    # -- the owner's side -------------------------------------------------------------------
    def run_stages(self, hidden, positions, inputs, decode_only, meta):
        t0 = time.monotonic()
        step = next(self._ids)
        answers: queue.Queue = queue.Queue()
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"member {self.member}: the group is broken: {self._broken}")
            self._pending[step] = answers
        try:
            parts = self._parts(inputs, decode_only)
            self.micro_batches += len(parts)
            out: list[torch.Tensor] = []
            for mb, (lo, hi) in enumerate(parts):
                if len(parts) == 1:
                    h, pos, inp = hidden, positions, msgspec.structs.replace(inputs, sample_seqs=[])
                else:
                    h, pos, inp = hidden[lo:hi].clone(), positions[lo:hi].clone(), _rows(inputs, lo, hi)
                self._start(step, mb, h, pos, inp, decode_only)
                if not self.overlap:
                    out += self._collect(step, answers, [mb])
            if self.overlap:
                out = self._collect(step, answers, list(range(len(parts))))
        finally:
            with self._lock:
                del self._pending[step]
        self._last_step_s = time.monotonic() - t0
        return out[0] if len(out) == 1 else torch.cat(out)

    def _parts(self, inputs: BatchInputs, decode_only: bool) -> list[tuple[int, int]]:
        n = inputs.num_decodes
        if self.lookahead is None or not decode_only or n < 2:
            return [(0, int(inputs.input_ids.shape[0]))]
        contexts = inputs.context_lens.tolist()
        return micro_batch_rows(contexts, self.lookahead, len(self.stages), self._peers_cost())

    def _start(self, step: int, mb: int, hidden, positions, inputs, decode_only) -> None:
        """A micro-batch into the chain: this member's layers here if it holds layer 0."""
        msg = {"kind": "chain", "owner": self.member, "step": step, "mb": mb, "stage": 0,
               "hidden": hidden, "positions": positions, "inputs": inputs,
               "decode_only": decode_only}
        if self.member == 0:
            with torch.inference_mode():
                msg["hidden"] = self.local.run(hidden, positions, inputs, decode_only,
                                               _meta(self.local, inputs, decode_only))
            msg["stage"] = 1
        self._hop(msg["stage"], msg)

    def _collect(self, step: int, answers: queue.Queue, mbs: list[int]) -> list[torch.Tensor]:
        """The final hidden states of micro-batches ``mbs``, in order."""
        deadline = time.monotonic() + self.step_timeout_s
        got: dict[int, torch.Tensor] = {}
        n = len(mbs)
        while len(got) < n:
            try:
                answer = answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"member {self.member}: step {step} got {len(got)} of {n} micro-batches "
                    f"back within {self.step_timeout_s} s (a member of the chain hung)") from None
            if "error" in answer:
                raise RuntimeError(f"member {self.member}: step {step} failed: "
                                   f"{answer['error']}")
            got[answer["mb"]] = answer["hidden"]
        return [got[i] for i in mbs]

    def _hop(self, peer: int, msg: dict) -> None:
        self.activation_hops += 1
        self.activation_bytes += msg["hidden"].numel() * msg["hidden"].element_size()
        self.links.send(peer, msg, TrafficClass.ACTIVATION)

    # -- every member's side: the link threads ---------------------------------------------
    def on_chain(self, peer: int, msg: dict) -> None:
        """Run this member's layers on a micro-batch that reached it; forward it or answer."""
        owner, me = msg["owner"], self.member
        try:
            if msg["stage"] != me:
                raise RuntimeError(f"member {me} got the chain for member {msg['stage']}")
            if self._broken is not None:   # the next hop may be the lost member: answer now
                raise RuntimeError(f"the group is broken: {self._broken}")
            inputs, decode_only = msg["inputs"], msg["decode_only"]
            with torch.inference_mode():
                hidden = self.local.run(msg["hidden"], msg["positions"], inputs, decode_only,
                                        _meta(self.local, inputs, decode_only))
            if owner != me:
                self.stage_runs += 1
                self._note_load(owner, msg["step"], inputs, decode_only)
            if me + 1 < len(self.stages):
                self._hop(me + 1, {**msg, "stage": me + 1, "hidden": hidden})
                return
            answer = {"kind": "result", "step": msg["step"], "mb": msg["mb"], "hidden": hidden}
        except Exception as exc:  # noqa: BLE001 - the owner fails its step with it
            answer = {"kind": "result", "step": msg["step"], "mb": msg["mb"],
                      "error": f"member {me}: {exc!r}"}
        if owner == me:
            self.on_result(answer)
        else:
            self._answer(owner, answer)

    def _answer(self, owner: int, answer: dict) -> None:
        try:
            self.links.send(owner, answer, TrafficClass.ACTIVATION)
        except (KeyError, OSError):
            pass   # the owner's link is gone: it fails its step from that break

    def on_result(self, msg: dict) -> None:
        with self._lock:
            answers = self._pending.get(msg["step"])
        if answers is not None:   # else a step that already failed
            answers.put(msg)

    def fail(self, reason: str) -> None:
        """A member is lost: every waiting step fails now, and every later one at once."""
        with self._lock:
            self._broken = self._broken or reason
            waiting = list(self._pending.values())
        for answers in waiting:
            answers.put({"error": reason})

    # -- the group's load, seen from the chains passing through -----------------------------
    def _note_load(self, owner: int, step: int, inputs: BatchInputs, decode_only: bool) -> None:
        if self.lookahead is None:
            return
        cost = self.lookahead.cost.batch([Chunk("", int(c), 1) for c in
                                          inputs.context_lens.tolist()]) if decode_only else 0.0
        now = time.monotonic()
        with self._lock:
            last = self._peer_load.get(owner)
            if last is not None and last[0] == step:        # another micro-batch of it
                self._peer_load[owner] = (step, last[1] + cost - self.lookahead.cost.epsilon,
                                          last[2], last[3])
            else:
                dt = 0.0 if last is None else now - last[2]
                self._peer_load[owner] = (step, cost, now, dt)

    def _peers_cost(self) -> list[float]:
        """The latest batch cost of each peer still stepping: one whose last chain passed
        within twice its own step interval (or this member's step time, if longer)."""
        now = time.monotonic()
        with self._lock:
            loads = sorted(self._peer_load.items())
        return [cost for _, (_, cost, t, dt) in loads
                if now - t <= 2.0 * max(dt, self._last_step_s)]
