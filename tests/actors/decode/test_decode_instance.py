"""A TP-2 decode instance of Ray actors: lockstep engines, continuous batching, KV fed by
real send managers over NIXL, aborts and transfer failures that leave nothing held. Decoded
tokens equal the single TP-1 engine's, and so do their logprobs (tests/exactness.py)."""

from __future__ import annotations

import asyncio
import sys
import time

import msgspec
import pytest
import ray
import torch
from exactness import TOP, assert_same_run, engine_runs

from tetris.actors.decode.instance import DecodeError, DecodeFull, DecodeInstance, DecodeInstanceLost
from tetris.actors.decode.messages import KVTransferFailed
from tetris.errors import InstanceLost
from tetris.actors.transfer_pump import TRANSFER_GROUP, TransferPump
from tetris.config import DecodeConfig, DeploymentConfig, ModelConfig, TransferConfig
from tetris.engine.engine import LLMEngine
from tetris.engine.request import OutputDelta
from tetris.kernels.attention import attention_with_lse
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams
from tetris.transfer.backends import make_agent, nixl_unavailable_reason
from tetris.transfer.messages import Grant
from tetris.transfer.send_manager import SendManager
from tetris.transfer.states import ShardSent, TransferFailed

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, seed=5)
DEPLOYMENT = DeploymentConfig(model=MODEL, decode=DecodeConfig(
    tp_size=2, max_batch_size=4, block_size=4, kv_blocks=48))
# Small pieces (8 tokens of 128 B) so that a layer of a shard takes several grants; a short
# timeout so that the stalled-sender test ends quickly (but not before a loaded machine has
# replaced a sender in the replaced-sender test).
TRANSFER = TransferConfig(num_backends=2, pool_size=2, backend_buffer_bytes=1024,
                          send_buffer_bytes=1024, bulk_chunk_bytes=1024, timeout_s=8.0,
                          abort_grace_s=0.2, backend="nixl")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
GREEDY_LP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=TOP)


class TestSender:
    """A prefill instance's transfer side only: a SendManager driven by a TransferPump."""

    __test__ = False

    def __init__(self, sender_id: int, config: TransferConfig) -> None:
        torch.set_num_threads(1)
        self.agent = make_agent(f"prefill-{sender_id}", backend=config.backend)
        self.mgr = SendManager(sender_id, self.agent, config)
        self.drop_grants = False
        self.pump = TransferPump(self.mgr, name=f"test-sender-{sender_id}",
                                 on_events=self._on_events).start()

    def _on_events(self, events) -> None:
        with self.pump.locked() as mgr:
            for e in events:
                if isinstance(e, (ShardSent, TransferFailed)):
                    mgr.forget(e.request_id)

    def connect(self, infos, peers) -> None:
        for info in infos:
            self.agent.add_peer(info)
        self.pump.connect(peers)

    def set_drop_grants(self, drop: bool) -> None:
        self.drop_grants = drop   # a sender that handshakes and then never writes

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def deliver_transfer(self, msgs) -> None:
        if self.drop_grants:
            msgs = [m for m in msgs if not isinstance(m, Grant)]
        self.pump.deliver(msgs)

    def send(self, request_id: str, receiver_id: int, prompt_tokens: int, chunk_index: int,
             chunk: tuple[int, int], kv: list[torch.Tensor], layers: int) -> None:
        """Handshake one shard (the whole chunk) and hand over its first ``layers`` layers."""
        a, b = chunk
        with self.pump.locked() as mgr:
            mgr.add_shard(request_id=request_id, chunk_index=chunk_index, receiver_id=receiver_id,
                          prompt_tokens=prompt_tokens, chunk=chunk, ranges=[chunk],
                          num_layers=len(kv), kv_heads=kv[0].shape[2], head_dim=kv[0].shape[3],
                          dtype=kv[0].dtype, now=time.monotonic())
            for layer in range(layers):
                mgr.layer_ready(request_id, chunk_index, layer, kv[layer][a:b].clone())

    def held(self) -> list:
        with self.pump.locked() as mgr:
            return sorted(mgr.shards)

    def first_token(self, request_id: str, receivers, token: int) -> None:
        """The first token, sent with the KV as the prefill member that sampled it does."""
        with self.pump.locked() as mgr:
            mgr.first_token(request_id, receivers, token)


# Ray workers cannot import test modules: ship the test sender's class by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
TestSenderActor = ray.remote(num_cpus=0, concurrency_groups={TRANSFER_GROUP: 1})(TestSender)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


class Reference:
    """The single-process TP-1 model: greedy outputs and prompt KV."""

    def __init__(self) -> None:
        self.model, tok = load_model(MODEL)
        self.engine = LLMEngine(self.model, tok, num_blocks=64, block_size=4, max_num_seqs=4)

    def generate(self, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        return list(self.engine.generate([prompt], params)[0].token_ids)

    def run(self, prompt: list[int]):
        """Greedy tokens and their logprobs (``GREEDY_LP``)."""
        self.runs = getattr(self, "runs", 0) + 1
        return engine_runs(self.engine, [prompt], GREEDY_LP, f"ref{self.runs}")[0]

    def prompt_kv(self, prompt: list[int]) -> list[torch.Tensor]:
        """Per layer [T, 2, Hkv, D]: the K (after RoPE) and V that the prompt leaves in a cache."""
        kv: list[torch.Tensor] = []

        def attention(i, q, k, v):
            kv.append(torch.stack([k, v], dim=1))
            return attention_with_lse(q, k, v, causal=True)[0]

        with torch.no_grad():
            self.model(torch.tensor(prompt), torch.arange(len(prompt)), attention)
        return kv


@pytest.fixture(scope="module")
def reference():
    return Reference()


@pytest.fixture(scope="module")
def cluster(ray_session, loop):
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    inst = DecodeInstance(DEPLOYMENT, 0, transfer=TRANSFER)
    loop.run_until_complete(inst.start())
    assert inst.receiver_ids == (0, 1)
    infos = loop.run_until_complete(inst.agent_infos())
    # Sender r streams to TP rank r only (its KV head slice), so each sender has one receiver.
    senders = [TestSenderActor.remote(r, TRANSFER) for r in range(2)]
    ray.get([s.connect.remote(infos, {r: inst.ranks[r]}) for r, s in enumerate(senders)])
    loop.run_until_complete(inst.connect_senders(dict(enumerate(senders))))
    yield inst, senders
    loop.run_until_complete(inst.shutdown())
    for s in senders:
        ray.kill(s)


async def _send_kv(senders, request_id: str, kv: list[torch.Tensor], chunks, layers: int | None = None,
                   receivers: tuple[int, ...] = (0, 1)):
    """Rank r (receiver ``receivers[r]``) gets heads [r, r+1) (Hkv 2 over TP 2) of every chunk
    from sender r."""
    n = kv[0].shape[0]
    refs = []
    for r, s in enumerate(senders):
        shard = [layer_kv[:, :, r:r + 1].contiguous() for layer_kv in kv]
        for c, chunk in enumerate(chunks):
            refs.append(s.send.remote(request_id, receivers[r], n, c, chunk, shard,
                                      len(kv) if layers is None else layers))
    await asyncio.gather(*refs)


async def _collect(inst, request_id: str) -> list:
    return [out async for out in inst.stream(request_id)]


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _logprobs(outs) -> list:
    return [e for o in outs for e in o.new_logprobs]


async def _wait_empty(inst, senders, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        held = await inst.held()
        shards = await asyncio.gather(*[s.held.remote() for s in senders])
        if all(h.empty for h in held) and not any(shards):
            return held
        if time.monotonic() > deadline:
            raise AssertionError(f"still held: ranks {held}, senders {shards}")
        await asyncio.sleep(0.02)


def test_local_path_tp2_matches_single_engine_with_continuous_batching(cluster, loop, reference):
    inst, senders = cluster
    prompts = {"a": _prompt(5, 1), "b": _prompt(11, 2), "c": _prompt(17, 3)}
    ref = {k: reference.engine.generate([p], GREEDY)[0] for k, p in prompts.items()}
    want = {k: reference.run(p) for k, p in prompts.items()}

    async def body():
        await inst.add("a", prompts["a"], GREEDY_LP)
        await inst.add("b", prompts["b"], GREEDY_LP)
        stream_a = inst.stream("a")
        early = [await anext(stream_a), await anext(stream_a)]
        assert not early[-1].finished
        # "c" joins while "a" and "b" are mid-generation
        await inst.add("c", prompts["c"], GREEDY_LP)
        rest_a = [out async for out in stream_a]
        outs_b, outs_c = await asyncio.gather(_collect(inst, "b"), _collect(inst, "c"))
        return {"a": early + rest_a, "b": outs_b, "c": outs_c}

    got = loop.run_until_complete(body())
    for k, outs in got.items():
        assert_same_run(_tokens(outs), _logprobs(outs), want[k], k)
        assert outs[-1].num_tokens == len(want[k][0])
        assert outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
        assert "".join(o.new_text for o in outs) == ref[k].text
        # deltas only: neither the prompt nor the output so far travels with each token
        assert all(type(o) is OutputDelta for o in outs)
    loop.run_until_complete(_wait_empty(inst, senders))


def test_a_request_that_ends_before_its_stream_opens_still_streams(cluster, loop, reference):
    """The dispatcher opens the decode stream after the commit; a short request can finish in
    between, and its outputs must still reach the stream opened late (once a KeyError)."""
    inst, senders = cluster
    prompt = _prompt(7, 6)
    want = list(reference.engine.generate([prompt], GREEDY)[0].token_ids)

    async def body():
        await inst.add("early", prompt, GREEDY)
        deadline = time.monotonic() + 60
        while "early" not in inst._book.ended:     # finished, stream not yet opened
            assert time.monotonic() < deadline, "the request never finished"
            await asyncio.sleep(0.01)
        return await _collect(inst, "early")

    outs = loop.run_until_complete(body())
    assert _tokens(outs) == want and outs[-1].finished
    assert len(outs) == 1        # every step's delta was queued when the stream opened: merged
    assert "early" not in inst._book.ended
    loop.run_until_complete(_wait_empty(inst, senders))


def test_kv_fed_by_transfer_continues_like_single_engine(cluster, loop, reference):
    inst, senders = cluster
    prompts = {"t1": _prompt(13, 4), "t2": _prompt(9, 5)}
    want = {k: reference.run(p) for k, p in prompts.items()}
    kv = {k: reference.prompt_kv(p) for k, p in prompts.items()}

    async def body():
        for k, p in prompts.items():
            await inst.reserve(k, p, GREEDY_LP)
        # t1: first token known before its KV arrives; t2: after every rank has its KV
        # (with the prefill's logprob of it: what the decode ranks compute is the rest)
        inst.commit("t1", want["t1"][0][0], want["t1"][1][0])
        await _send_kv(senders, "t1", kv["t1"], [(0, 6), (6, 13)])
        await _send_kv(senders, "t2", kv["t2"], [(0, 9)])
        deadline = time.monotonic() + 20
        while not inst.transfer_ready("t2"):
            assert time.monotonic() < deadline, "t2's KV never completed on both ranks"
            await asyncio.sleep(0.01)
        inst.commit("t2", want["t2"][0][0], want["t2"][1][0])
        return await asyncio.gather(_collect(inst, "t1"), _collect(inst, "t2"))

    outs_t1, outs_t2 = loop.run_until_complete(body())
    assert_same_run(_tokens(outs_t1), _logprobs(outs_t1), want["t1"], "t1")
    assert_same_run(_tokens(outs_t2), _logprobs(outs_t2), want["t2"], "t2")
    assert outs_t1[0].new_token_ids[0] == want["t1"][0][0]   # the stream starts with the first token
    loop.run_until_complete(_wait_empty(inst, senders))


def test_first_token_with_the_kv_starts_decoding_without_a_commit(cluster, loop, reference):
    """The member that sampled the first token sends it with the KV (``FirstToken``; here
    sender 1 to rank 1 only, before the KV: any rank's copy will do): the request decodes
    like the single engine with no ``commit``; the dispatcher's commit of the same token
    afterwards changes nothing, and a different token is refused."""
    inst, senders = cluster
    prompt = _prompt(11, 12)
    want, kv = reference.generate(prompt), reference.prompt_kv(prompt)

    async def body():
        await inst.reserve("ft", prompt, GREEDY)
        await senders[1].first_token.remote("ft", [inst.receiver_ids[1]], want[0])
        await _send_kv(senders, "ft", kv, [(0, 5), (5, 11)])
        stream = inst.stream("ft")
        first = await asyncio.wait_for(anext(stream), 60)   # no commit: it must start alone
        inst.commit("ft", want[0])                        # late, same token: a no-op
        with pytest.raises(ValueError, match="already committed"):
            inst.commit("ft", want[0] + 1)
        return [first] + [out async for out in stream]

    outs = loop.run_until_complete(body())
    assert _tokens(outs) == want and outs[-1].finished
    loop.run_until_complete(_wait_empty(inst, senders))


def test_abort_while_receiving_and_after_admission_frees_everything(cluster, loop, reference):
    inst, senders = cluster
    prompt = _prompt(12, 6)
    kv = reference.prompt_kv(prompt)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def body():
        await inst.reserve("r1", prompt, GREEDY)
        await _send_kv(senders, "r1", kv, [(0, 12)], layers=1)   # half the layers, then stall
        inst.abort("r1")
        inst.abort("r1")   # idempotent
        outs_r1 = await _collect(inst, "r1")
        await _wait_empty(inst, senders)

        await inst.add("r2", prompt, long)
        stream = inst.stream("r2")
        first = [await anext(stream), await anext(stream)]
        inst.abort("r2")
        outs_r2 = first + [o async for o in stream]
        await _wait_empty(inst, senders)

        await inst.add("r3", prompt, long)
        async for _ in inst.stream("r3"):
            break   # a caller that walks away aborts its request
        await _wait_empty(inst, senders)
        return outs_r1, outs_r2

    outs_r1, outs_r2 = loop.run_until_complete(body())
    assert outs_r1[-1].finish_reason == "abort" and outs_r1[-1].num_tokens == 0
    assert outs_r2[-1].finish_reason == "abort" and 2 <= outs_r2[-1].num_tokens < 100
    assert outs_r2[-1].num_tokens == len(_tokens(outs_r2))


def test_stalled_sender_fails_the_stream_and_frees_everything(cluster, loop, reference):
    inst, senders = cluster
    prompt = _prompt(10, 7)
    kv = reference.prompt_kv(prompt)
    first = reference.generate(prompt)[0]
    ray.get(senders[0].set_drop_grants.remote(True))
    try:
        async def body():
            await inst.reserve("s1", prompt, GREEDY)
            await _send_kv(senders, "s1", kv, [(0, 10)])
            inst.commit("s1", first)
            t0 = time.monotonic()
            with pytest.raises(DecodeError, match="rank 0.*timed out") as e:
                await _collect(inst, "s1")
            # nothing wrong with the request: the dispatcher prefills it again
            assert isinstance(e.value, KVTransferFailed) and isinstance(e.value, InstanceLost)
            return time.monotonic() - t0

        waited = loop.run_until_complete(body())
        assert waited >= TRANSFER.timeout_s * 0.9
        loop.run_until_complete(_wait_empty(inst, senders))
    finally:
        ray.get(senders[0].set_drop_grants.remote(False))


def test_a_replaced_sender_fails_what_it_owed_at_once_not_at_the_timeout(cluster, loop, reference):
    """The prefill pool replaced a dead worker and connected its successor: the decode ranks
    give up the shards the dead one still owed there and then (the request fails as an
    ``InstanceLost``, which the dispatcher runs again), instead of stalling until the transfer
    timeout; the successor is used from then on."""
    inst, senders = cluster
    prompt = _prompt(12, 8)
    kv = reference.prompt_kv(prompt)
    first = reference.generate(prompt)[0]
    old = senders[0]
    ray.get(old.set_drop_grants.remote(True))      # it handshakes, then never writes: "dies"
    successor = TestSenderActor.remote(0, TRANSFER)
    ray.get(successor.connect.remote(loop.run_until_complete(inst.agent_infos()), {0: inst.ranks[0]}))

    async def body():
        await inst.reserve("lost-1", prompt, GREEDY)
        await _send_kv(senders, "lost-1", kv, [(0, 12)])
        inst.commit("lost-1", first)
        # The old sender's handshake must have reached rank 0 (which then holds a backend for
        # it) before it dies: killed first, nothing would be owed to give up, and the request
        # would wait for the transfer timeout instead (a race of this test, not of the code).
        deadline = time.monotonic() + 30
        while not (await inst.ranks[0].held.remote()).backends_held:
            assert time.monotonic() < deadline, "the old sender's handshake never arrived"
            await asyncio.sleep(0.05)
        ray.kill(old)
        senders[0] = successor
        await inst.connect_senders({0: successor})
        with pytest.raises(KVTransferFailed, match="prefill instance 0 lost") as e:
            await _collect(inst, "lost-1")
        assert isinstance(e.value, InstanceLost)
        # the successor streams the next request in full
        await inst.reserve("lost-2", prompt, GREEDY)
        await _send_kv(senders, "lost-2", kv, [(0, 12)])
        inst.commit("lost-2", first)
        return await _collect(inst, "lost-2")

    outs = loop.run_until_complete(body())
    assert _tokens(outs) == reference.generate(prompt)
    loop.run_until_complete(_wait_empty(inst, senders))


def test_full_instance_raises_decode_full_and_idles_without_rounds(cluster, loop):
    inst, senders = cluster
    # what its ranks allocated, read at start: the dispatcher plans with it
    assert inst.kv_capacity_tokens == DEPLOYMENT.decode.kv_blocks * DEPLOYMENT.decode.block_size

    async def body():
        # 100 tokens need 26 of the 48 blocks: the second reservation cannot fit
        await inst.reserve("f1", _prompt(100, 8), GREEDY)
        with pytest.raises(DecodeFull) as info:
            await inst.reserve("f2", _prompt(100, 9), GREEDY)
        assert info.value.retry_after_s > 0
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await inst.add("bad", [MODEL.vocab_size], GREEDY)
        inst.abort("f1")
        await _collect(inst, "f1")
        await _wait_empty(inst, senders)
        rounds = inst.rounds
        await asyncio.sleep(0.3)
        return inst.rounds - rounds

    assert loop.run_until_complete(body()) == 0   # nothing pending: no rounds, no spinning
    assert inst.stats().free_blocks == DEPLOYMENT.decode.kv_blocks


def test_rank_in_process_tp1_commands_and_rejections(reference):
    """A TP-1 rank without Ray: the command semantics the driver relies on."""
    from tetris.actors.decode.messages import Abort, Add, Commit, Reserve
    from tetris.actors.decode.rank import DecodeRank

    deployment = DeploymentConfig(model=MODEL, decode=DecodeConfig(
        tp_size=1, max_batch_size=2, block_size=4, kv_blocks=16))
    rank = DecodeRank(7, 0, 1, deployment)
    with pytest.raises(RuntimeError, match="init_group"):
        rank.step([])
    rank.init_group("127.0.0.1", 0, 10.0)
    assert "no KV transfer" in rank.step([Reserve("x", (1, 2), GREEDY)]).rejected[0].reason
    rank.enable_transfer(msgspec.structs.replace(TRANSFER, backend="inproc"))
    try:
        prompt = _prompt(9, 10)
        reply = rank.step([Reserve("x", tuple(prompt), GREEDY),
                           Reserve("x", tuple(prompt), GREEDY),            # duplicate id
                           Reserve("big", tuple(_prompt(60, 11)), GREEDY),  # 16 blocks, 13 left
                           Commit("nobody", 3)])
        assert [(r.request_id, r.full) for r in reply.rejected] == [("x", False), ("big", True),
                                                                     ("nobody", False)]
        assert reply.outputs == [] and reply.stats.receiving == 1
        held = rank.held()
        assert held.receiving == ["x"] and held.free_blocks == 16 - 3 and not held.empty
        reply = rank.step([Abort("x"), Abort("x"), Add("y", tuple(prompt), GREEDY)])
        assert [(d.request_id, d.finish_reason) for d in reply.outputs] == [("x", "abort"), ("y", None)]
        tokens = list(reply.outputs[1].new_token_ids)
        while not reply.outputs or not reply.outputs[-1].finished:
            reply = rank.step([])
            tokens.extend(t for d in reply.outputs for t in d.new_token_ids)
        assert tokens == reference.generate(prompt)
        assert reply.outputs[-1].num_tokens == len(tokens)
        assert rank.held().empty
    finally:
        rank.shutdown()


def test_a_dead_rank_breaks_the_instance_and_a_restart_brings_it_back(ray_session, loop, reference):
    """A TP rank dies while the instance is idle: ``check`` finds it and fails nothing else;
    a request on the broken instance is refused with ``DecodeError``; ``restart`` replaces the
    ranks (new transfer agents under the same names), the senders re-add the new agents, and a
    KV-fed request then decodes exactly as before. Nothing is left held, no old rank lives."""
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    inst = DecodeInstance(DEPLOYMENT, 1, transfer=TRANSFER)   # receivers 2, 3
    senders = [TestSenderActor.remote(r, TRANSFER) for r in range(2)]   # ids < pool_size
    prompt = _prompt(10, 8)
    want, kv = reference.run(prompt), reference.prompt_kv(prompt)

    async def wire():
        infos = await inst.agent_infos()
        await asyncio.gather(*[s.connect.remote([infos[r]], {inst.receiver_ids[r]: inst.ranks[r]})
                               for r, s in enumerate(senders)])

    async def kv_fed(rid: str) -> list:
        await inst.reserve(rid, prompt, GREEDY_LP)
        inst.commit(rid, want[0][0], want[1][0])
        await _send_kv(senders, rid, kv, [(0, 4), (4, 10)], receivers=inst.receiver_ids)
        return await _collect(inst, rid)

    async def body():
        await inst.start()
        await wire()
        await inst.connect_senders(dict(enumerate(senders)))
        before = await kv_fed("before")
        old = list(inst.ranks)
        assert await inst.check() is None
        ray.kill(old[1])
        deadline = time.monotonic() + 30
        while await inst.check() is None:
            assert time.monotonic() < deadline, "the dead rank was never noticed"
            await asyncio.sleep(0.1)
        assert isinstance(inst.broken, ray.exceptions.RayActorError)
        with pytest.raises(DecodeInstanceLost, match="broken"):
            await inst.add("refused", prompt, GREEDY)
        await inst.restart()
        assert inst.broken is None and inst.restarts == 1 and inst.ranks[0] is not old[0]
        await wire()                      # the senders learn the new agents' addresses
        after = await kv_fed("after")
        await _wait_empty(inst, senders)
        return before, after, old

    try:
        before, after, old = loop.run_until_complete(body())
        assert_same_run(_tokens(before), _logprobs(before), want, "before")
        assert_same_run(_tokens(after), _logprobs(after), want, "after the restart")
        for rank in old:                  # the survivor was killed too: no orphan actors
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(rank.__ray_ready__.remote(), timeout=30)
    finally:
        loop.run_until_complete(inst.shutdown())
        for s in senders:
            ray.kill(s)
