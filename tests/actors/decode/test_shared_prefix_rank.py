"""A decode rank reads a kept run's prefix from shared blocks (engine/kept_kv.py), without Ray:
a TP-1 ``DecodeRank`` in this process keeps turn 1, reserves turn 2 sharing turn 1's full
blocks and copying the boundary block, and receives only the suffix's KV from a real
``SendManager`` over the in-process backend (staged, and written directly into the blocks).
Turn 2's greedy tokens and logprobs equal the single engine's; the reservation took only the
unshared blocks; turn 1's blocks hold the same bytes after turn 2 ran (no write reached a
shared block); every block is free once the kept runs are dropped."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch
from exactness import TOP, assert_same_run, engine_runs
from ranks import Sender, link, prefill, wait_received
from tetris.actors.decode.messages import Abort, Commit, Reserve
from tetris.actors.decode.rank import DecodeRank

from tetris.config import DecodeConfig, DeploymentConfig, ModelConfig, TransferConfig
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

MODEL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, seed=5)
BS = 4
BLOCKS = 40
DEPLOYMENT = DeploymentConfig(model=MODEL, decode=DecodeConfig(
    tp_size=1, max_batch_size=4, block_size=BS, kv_blocks=BLOCKS))
STAGED = TransferConfig(num_backends=2, pool_size=2, backend_buffer_bytes=4096,
                        send_buffer_bytes=4096, bulk_chunk_bytes=4096, timeout_s=20.0,
                        backend="inproc")
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=TOP)
P1 = torch.randint(0, MODEL.vocab_size, (22,), generator=torch.Generator().manual_seed(3)).tolist()
_names = itertools.count()


def _turn(rank, sender, model, rid, prompt, start=0, **reserve):
    """Reserve, stream ``[start, n)``, commit and decode: (tokens, logprobs, free blocks
    right after the reservation)."""
    reply = rank.step([Reserve(rid, tuple(prompt), PARAMS, **reserve)])
    assert not reply.rejected, reply.rejected
    free_after_reserve = rank.held().free_blocks
    kv, first, logprob = prefill(model, prompt)
    sender.send(rid, rank.receiver_id, kv, [(start, len(prompt))])
    wait_received(rank)
    replies = [rank.step([Commit(rid, first, logprob)])]
    replies += [rank.step([]) for _ in range(PARAMS.max_tokens)]
    tokens, lps = [], []
    for r in replies:
        assert not r.failed and not r.rejected
        for d in r.outputs:
            tokens += d.new_token_ids
            lps += list(d.new_logprobs)
    return tokens, lps, free_after_reserve


@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct-writes"])
def test_turn_two_reads_turn_one_s_shared_blocks_and_equals_the_engine(direct):
    model, tok = load_model(MODEL)
    config = msgspec.structs.replace(STAGED, direct_writes=direct)
    rank = DecodeRank(0, 0, 1, DEPLOYMENT)
    rank.init_group("127.0.0.1", 0, 30.0)
    sender = Sender(f"shared-prefix-send-{next(_names)}", STAGED)
    try:
        link(rank, sender, config)
        out1, _, _ = _turn(rank, sender, model, "t1", P1, keep=True)
        kept_table = list(rank.kept.runs["t1"][0])   # 22 + 5 positions: 7 blocks
        assert len(kept_table) == 7 and rank.held().kept == ["t1"]
        before = rank.engine.cache.buffer[:, :, kept_table].clone()   # [L, 2, 7, BS, Hkv, D]
        p2 = P1 + out1 + [7, 8, 9]   # 31 tokens
        want = engine_runs(LLMEngine(model, tok, num_blocks=64, block_size=BS), [p2], PARAMS)[0]
        free = rank.held().free_blocks
        # 26 of turn 1's 27 positions: 6 full blocks shared, positions 24 and 25 copied
        tokens, lps, free_reserved = _turn(rank, sender, model, "t2", p2, start=26,
                                           prefix_from="t1", prefix_tokens=26)
        assert_same_run(tokens, lps, want, "turn 2 from shared blocks")
        assert free - free_reserved == 8 - 6   # 31 tokens (and the first output): 8 blocks
        # every layer's K and V of turn 1's blocks as turn 1 left them: no write reached them
        assert torch.equal(rank.engine.cache.buffer[:, :, kept_table], before)
        rank.step([Abort("t1", "dropped")])
        assert rank.held().free_blocks == BLOCKS and rank.kept.runs == {}
    finally:
        sender.pump.stop()
        rank.shutdown()


def test_an_emulated_engine_shares_kept_blocks_alike():
    """EMULATION: the emulated decode engine stores no KV, but its blocks are shared and
    counted as the real engine's are."""
    from tetris.actors.decode.emulated import EmulatedDecodeEngine

    from tetris.engine.kept_kv import KeptKV

    dep = msgspec.structs.replace(DEPLOYMENT, decode=msgspec.structs.replace(
        DEPLOYMENT.decode, kv_blocks=16))
    engine = EmulatedDecodeEngine(dep, tp_size=1, kv_heads=2, sleep=lambda s: None)
    kept = KeptKV(engine)
    kept.want("t1")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.reserve_blocks("t1", [1] * 22, params)
    engine.commit_prefilled("t1", 2)
    while engine.has_unfinished():
        engine.step()
    assert kept.tokens("t1") == 27 and engine.num_free_blocks == 16 - 7
    table = engine.reserve_blocks("t2", [1] * 31, params, shared=kept.shared_blocks("t1", 26))
    kept.copy_boundary("t1", table, 26)
    assert table[:6] == kept.runs["t1"][0][:6] and engine.num_free_blocks == 16 - 7 - 2
    assert kept.drop("t1") and engine.num_free_blocks == 16 - 8   # t2 holds its 8
    engine.abort_request("t2")
    engine.blocks.check({})
    assert engine.num_free_blocks == 16
