"""What the decode-rank tests that run without Ray share: a peer called directly in this
process, a prefill's transfer side (a real ``SendManager`` on a pump over the in-process
backend), the prompt's KV as the prefill computes it, and the wait for a rank's KV to land."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from exactness import logprobs_of_logits
from tetris.actors.decode.elastic import Hold, Lead, range_transfer_id
from tetris.actors.decode.messages import Reserve
from tetris.actors.transfer_pump import TransferPump
from tetris.kernels.attention import attention_with_lse
from tetris.transfer.backends import make_agent
from tetris.transfer.send_manager import SendManager
from tetris.transfer.states import ShardSent, TransferFailed

from tetris.config import TransferConfig


class Direct:
    """A peer in this process: its ``deliver_transfer.remote`` is a direct call."""

    def __init__(self, obj) -> None:
        self.deliver_transfer = SimpleNamespace(remote=obj.deliver_transfer)


class Sender:
    """A prefill instance's transfer side: a SendManager on a pump. With ``strict`` a failed
    transfer fails the test; without it the failure is forgotten like a sent shard."""

    def __init__(self, agent_name: str, config: TransferConfig, sender_id: int = 0,
                 pump_name: str = "sender", strict: bool = True) -> None:
        self.strict = strict
        self.agent = make_agent(agent_name, backend="inproc")
        self.pump = TransferPump(SendManager(sender_id, self.agent, config), name=pump_name,
                                 on_events=self._done).start()

    def _done(self, events) -> None:
        with self.pump.locked() as mgr:
            for e in events:
                assert not (self.strict and isinstance(e, TransferFailed)), e
                if isinstance(e, (ShardSent, TransferFailed)):
                    mgr.forget(e.request_id)

    def deliver_transfer(self, msgs) -> None:
        self.pump.deliver(msgs)

    def send(self, rid: str, receiver: int, kv: list[torch.Tensor],
             chunks: list[tuple[int, int]] | None = None) -> None:
        """Positions ``[a, b)`` of every layer for each chunk (default: the whole of ``kv``
        as one chunk), chunk i as the shard's chunk_index i."""
        n = kv[0].shape[0]
        with self.pump.locked() as mgr:
            for chunk, (a, b) in enumerate(chunks or [(0, n)]):
                mgr.add_shard(request_id=rid, chunk_index=chunk, receiver_id=receiver,
                              prompt_tokens=n, chunk=(a, b), ranges=[(a, b)],
                              num_layers=len(kv), kv_heads=kv[0].shape[2],
                              head_dim=kv[0].shape[3], dtype=kv[0].dtype, now=time.monotonic())
                for layer, layer_kv in enumerate(kv):
                    mgr.layer_ready(rid, chunk, layer, layer_kv[a:b].clone())


def link(rank, sender: Sender, config: TransferConfig, sender_id: int = 0) -> None:
    """Enable the rank's receive side and connect it and the sender both ways."""
    sender.agent.add_peer(rank.enable_transfer(config))
    rank.connect_senders({sender_id: Direct(sender)})
    sender.pump.connect({rank.receiver_id: Direct(rank)})


def wait_received(rank, timeout_s: float = 30.0) -> None:
    """Until the rank's pump thread has placed every piece it is receiving."""
    deadline = time.monotonic() + timeout_s
    while rank.held().receiving:
        assert time.monotonic() < deadline, rank.held()
        time.sleep(0.01)


@torch.inference_mode()
def prefill(model, prompt):
    """Per layer [T, 2, Hkv, D] of the prompt's KV, the first token and its logprob."""
    kv = []

    def attention(i, q, k, v):
        kv.append(torch.stack([k, v], dim=1))
        return attention_with_lse(q, k, v, causal=True)[0]

    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), attention)
    row = model.logits(hidden[-1:], upcast=True)[0]
    first = int(row.argmax())
    return kv, first, logprobs_of_logits([row], [first])[0]


def placement_commands(me: int, prompts, placements, keys, params):
    """Round 0's reservations on instance ``me`` for ``placements`` (request -> [(instance,
    start, end)], the last range's instance masters it), the ranges it is sent as
    (transfer id, request, start, end), and round 1's commits."""
    reserve, sends, commits = [], [], []
    for rid, ranges in placements.items():
        master, kv_start, _ = ranges[-1]
        for inst, s, e in ranges[:-1]:
            if inst == me:
                reserve.append(Hold(rid, keys[rid], master, s, e))
                sends.append((range_transfer_id(rid, s), rid, s, e))
        if master == me:
            reserve.append(Reserve(rid, tuple(prompts[rid]), params, kv_start=kv_start))
            if kv_start:
                reserve.append(Lead(rid, keys[rid], tuple(i for i, _, _ in ranges[:-1])))
            sends.append((rid, rid, kv_start, len(prompts[rid])))
            commits.append(rid)
    return reserve, sends, commits
