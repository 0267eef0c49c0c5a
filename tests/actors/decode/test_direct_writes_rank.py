"""Direct writes into a decode rank's own KV blocks (transfer/direct.py), without Ray: a TP-1
``DecodeRank`` in this process receives every request's KV from a real ``SendManager`` over
the in-process backend, once staged and once with ``transfer.direct_writes``; both decode the
single engine's greedy tokens and logprobs, and the two caches hold the same bytes."""

from __future__ import annotations

import itertools
import time

import msgspec
import torch
from exactness import TOP, assert_same_run, engine_runs
from ranks import Direct, Sender, link, prefill, wait_received
from tetris.actors.decode.messages import Abort, Commit, Reserve
from tetris.actors.decode.rank import DecodeRank
from tetris.transfer.backends import make_agent
from tetris.transfer.send_manager import SendManager

from tetris.config import DecodeConfig, DeploymentConfig, ModelConfig, TransferConfig
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

MODEL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, seed=5)
BS = 4
DEPLOYMENT = DeploymentConfig(model=MODEL, decode=DecodeConfig(
    tp_size=1, max_batch_size=4, block_size=BS, kv_blocks=40))
STAGED = TransferConfig(num_backends=2, pool_size=2, backend_buffer_bytes=4096,
                        send_buffer_bytes=4096, bulk_chunk_bytes=4096, timeout_s=20.0,
                        backend="inproc")
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=TOP)
LENGTHS = {"a": 23, "b": 9, "c": 31}
_names = itertools.count()


def _prompts():
    g = torch.Generator().manual_seed(11)
    return {rid: torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()
            for rid, n in LENGTHS.items()}


def _decode(config: TransferConfig, prefills, prompts):
    """Every request's (tokens, logprobs) and the rank's KV cache after its KV arrived."""
    rank = DecodeRank(0, 0, 1, DEPLOYMENT)
    rank.init_group("127.0.0.1", 0, 30.0)
    sender = Sender(f"direct-rank-send-{next(_names)}", STAGED)
    try:
        link(rank, sender, config)
        replies = [rank.step([Reserve(rid, tuple(p), PARAMS) for rid, p in prompts.items()])]
        for rid, p in prompts.items():
            # two members' worth of shards: the prompt's halves as two chunks
            n = len(p)
            sender.send(rid, rank.receiver_id, prefills[rid][0], [(0, n // 2), (n // 2, n)])
        wait_received(rank)
        cache = rank.engine.cache.buffer.clone()
        with rank.pump.locked() as manager:   # bytes left in the receive staging buffers
            staged_bytes = sum(int(b.buffer.count_nonzero()) for b in manager.backends)
        replies.append(rank.step([Commit(rid, prefills[rid][1], prefills[rid][2])
                                  for rid in prompts]))
        replies += [rank.step([]) for _ in range(PARAMS.max_tokens)]
        runs = {}
        for reply in replies:
            assert not reply.failed and not reply.rejected
            for d in reply.outputs:
                tokens, lps = runs.setdefault(d.request_id, ([], []))
                tokens += d.new_token_ids
                lps += list(d.new_logprobs)
        assert rank.held().free_blocks == DEPLOYMENT.decode.kv_blocks
        return runs, cache, staged_bytes
    finally:
        sender.pump.stop()
        rank.shutdown()


def test_direct_writes_into_the_rank_s_blocks_decode_the_engine_s_tokens():
    model, tok = load_model(MODEL)
    prompts = _prompts()
    prefills = {rid: prefill(model, p) for rid, p in prompts.items()}
    engine = LLMEngine(model, tok, num_blocks=64, block_size=BS)
    want = dict(zip(prompts, engine_runs(engine, list(prompts.values()), PARAMS), strict=True))
    staged, staged_cache, through_staging = _decode(STAGED, prefills, prompts)
    direct, direct_cache, not_staged = _decode(msgspec.structs.replace(STAGED, direct_writes=True),
                                               prefills, prompts)
    assert through_staging > 0 and not_staged == 0   # direct: nothing in the receive buffers
    assert torch.equal(staged_cache, direct_cache)   # the same bytes in the same blocks
    assert int(direct_cache.count_nonzero()) > 0
    for runs, how in ((staged, "staged"), (direct, "direct")):
        assert set(runs) == set(prompts)
        for rid in sorted(prompts):
            tokens, lps = runs[rid]
            assert_same_run(tokens, lps, want[rid], f"{how} {rid}")


class _HeldSender:
    """A send manager driven by the test thread: the rank's pump hands it messages, the test
    decides when its write moves (the in-process backend copies at the next ``poll``)."""

    def __init__(self, config: TransferConfig) -> None:
        self.agent = make_agent(f"direct-hold-send-{next(_names)}", backend="inproc")
        self.mgr = SendManager(0, self.agent, config)
        self.inbox: list = []

    def deliver_transfer(self, msgs) -> None:   # the rank's pump thread
        self.inbox += msgs

    def run(self, rank) -> None:
        msgs, self.inbox = self.inbox, []
        now = time.monotonic()
        for m in msgs:
            self.mgr.deliver(m, now)
        self.mgr.poll(now)
        out = [env.msg for env in self.mgr.drain_outbox()]
        if out:
            rank.deliver_transfer(out)


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 20.0
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _abort_with_a_write_in_flight(config: TransferConfig):
    """(the rank, its sender, free blocks after the abort, the request's block count)."""
    rank = DecodeRank(0, 0, 1, DEPLOYMENT)
    rank.init_group("127.0.0.1", 0, 30.0)
    sender = _HeldSender(config)
    sender.agent.add_peer(rank.enable_transfer(config))
    rank.connect_senders({0: Direct(sender)})
    model, _ = load_model(MODEL)
    prompt = _prompts()["a"]
    kv = prefill(model, prompt)[0]
    rank.step([Reserve("x", tuple(prompt), PARAMS)])
    sender.mgr.add_shard(request_id="x", chunk_index=0, receiver_id=rank.receiver_id,
                         prompt_tokens=len(prompt), chunk=(0, len(prompt)),
                         ranges=[(0, len(prompt))], num_layers=len(kv), kv_heads=kv[0].shape[2],
                         head_dim=kv[0].shape[3], dtype=kv[0].dtype, now=time.monotonic())
    for layer, layer_kv in enumerate(kv):
        sender.mgr.layer_ready("x", 0, layer, layer_kv.clone())
    sender.run(rank)                                 # handshake and computed layers out
    _wait(lambda: sender.inbox, "no grant came")     # the rank's pump grants its one credit
    sender.run(rank)                                 # the grant in, the write posted
    assert sender.mgr.needs_polling()                # on the wire, not landed
    rank.step([Abort("x", "client gone")])
    return rank, sender, rank.stats().free_blocks, -(-len(prompt) // BS)


def test_an_aborted_request_s_blocks_stay_out_of_the_engine_until_its_write_landed():
    one_credit = msgspec.structs.replace(STAGED, backend_slots=1, direct_writes=True)
    rank, sender, free, blocks = _abort_with_a_write_in_flight(one_credit)
    total = DEPLOYMENT.decode.kv_blocks
    try:
        assert free == total - blocks                 # the engine cannot hand them out
        sender.mgr.poll(time.monotonic())             # the straggler lands, its notice after
        _wait(lambda: rank.step([]).stats.free_blocks == total, "the held blocks never came back")
        assert rank.held().empty
    finally:
        rank.shutdown()
        sender.agent.close()


def test_staged_pieces_let_the_engine_reuse_an_aborted_request_s_blocks_at_once():
    one_credit = msgspec.structs.replace(STAGED, backend_slots=1)
    rank, sender, free, _ = _abort_with_a_write_in_flight(one_credit)
    try:
        assert free == DEPLOYMENT.decode.kv_blocks    # a straggler lands in a fenced slot only
    finally:
        rank.shutdown()
        sender.agent.close()
