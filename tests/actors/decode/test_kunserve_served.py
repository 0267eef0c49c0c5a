"""KunServe on served decode instances (Ray rank actors, TP 1): on the controller's overload
decision two instances drop into one pipeline group in the middle of generation, and are
restored when demand falls; every request's tokens and
logprobs equal the single engine's, nothing is recomputed, the reported KV capacity grows by
exactly the freed parameter bytes over the block bytes; a drop that would lose a layer's last
copy is refused and changes nothing; a member killed mid-pipeline fails the group's requests
with ``DecodeInstanceLost`` (the dispatcher's resume path), the survivor is rebuilt in place
(same actor) and the dead one restarted, and the resumed requests go on exactly. The admin routes (mounted on the ingress) drive the same pool over HTTP."""

from __future__ import annotations

import asyncio
import types

import msgspec
import pytest
import ray
import torch
from exactness import TOP, assert_same_run, engine_runs
from test_decode_instance import TRANSFER, Reference, TestSenderActor
from tetris.actors.decode.instance import DecodeFull, DecodeInstance, DecodeInstanceLost
from tetris.actors.decode.kunserve_group import ServedKunServe
from tetris.transfer.backends import nixl_unavailable_reason

from tetris.config import DecodeConfig, DeploymentConfig, ModelConfig
from tetris.control.drop_plan import DropRefused, Group
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams
from tetris.serve.kunserve_served import KunServePool, add_kunserve_served_routes

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

# a wide MLP: parameters are most of an instance's memory, as where KunServe pays
MODEL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=384, num_layers=4,
                    num_heads=4, num_kv_heads=2, seed=5)
BLOCKS = 48
DEPLOYMENT = DeploymentConfig(model=MODEL, decode=DecodeConfig(
    num_instances=2, tp_size=1, max_batch_size=8, block_size=4, kv_blocks=BLOCKS))
MAX_TOKENS = 40
GREEDY_LP = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                           logprobs=TOP)
HALVES = Group((0, 1), ((0, 2), (2, 4)))


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


PROMPTS = [_prompt(n, s) for n, s in ((3, 1), (26, 2), (11, 3), (17, 4))]


@pytest.fixture(scope="module")
def pool(ray_session, loop):
    # KV transfer on (NIXL) where it can be: the landing test streams a prefilled prompt
    transfer = TRANSFER if nixl_unavailable_reason() is None else None
    insts = [DecodeInstance(DEPLOYMENT, i, transfer=transfer) for i in range(2)]
    kun = ServedKunServe(insts)

    async def start():
        await asyncio.gather(*[inst.start() for inst in insts])
        await kun.start()

    loop.run_until_complete(start())
    if transfer is not None:   # one prefill sender (id 0) that can stream to both instances
        sender = TestSenderActor.remote(0, TRANSFER)
        infos = [info for inst in insts for info in loop.run_until_complete(inst.agent_infos())]
        ray.get(sender.connect.remote(infos, {i: inst.ranks[0] for i, inst in enumerate(insts)}))
        for inst in insts:
            loop.run_until_complete(inst.connect_senders({0: sender}))
        insts[0].test_sender = sender
    yield insts, kun
    async def stop():
        await asyncio.gather(*[inst.shutdown() for inst in insts])

    loop.run_until_complete(stop())


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model(MODEL)
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4, max_num_seqs=8)
    return engine_runs(engine, PROMPTS, GREEDY_LP)


def _states(insts) -> list[dict]:
    return ray.get([inst.ranks[0].kunserve_state.remote() for inst in insts])


class Streams:
    """Each request's tokens and logprobs as they arrive; ``reached(n)`` waits until every
    request has at least n tokens (or finished)."""

    def __init__(self, prompts=PROMPTS) -> None:
        self.prompts = prompts
        self.runs: dict[int, tuple[list, list]] = {}
        self.finished: set[int] = set()
        self.changed = asyncio.Event()

    async def consume(self, inst, i: int, params: SamplingParams = GREEDY_LP) -> None:
        rid = f"k{i}"
        await inst.add(rid, self.prompts[i], params)
        self.runs[i] = ([], [])
        async for out in inst.stream(rid):
            self.runs[i][0].extend(out.new_token_ids)
            self.runs[i][1].extend(out.new_logprobs)
            if out.finished:
                self.finished.add(i)
            self.changed.set()

    async def reached(self, n: int) -> list[int]:
        while not (len(self.runs) == len(self.prompts)
                   and all(len(r[0]) >= n or i in self.finished
                           for i, r in self.runs.items())):
            self.changed.clear()
            await self.changed.wait()
        return [len(r[0]) for _, r in sorted(self.runs.items())]


@pytest.mark.parametrize("lookahead", [False, True], ids=["one-micro-batch", "lookahead"])
def test_drop_and_restore_mid_generation_equal_the_single_engine(pool, loop, reference,
                                                                lookahead):
    """With ``[kunserve] lookahead`` (its driver's ``lookahead_overhead_seqs``; 0 here, so
    that a member with no peer load known yet splits), members cut decode batches into
    micro-batches (§4.3), with the same tokens."""
    insts, kun = pool
    if lookahead:
        kun = ServedKunServe(insts, lookahead_overhead_seqs=0.0)
        loop.run_until_complete(kun.start())
    streams = Streams()

    async def body():
        tasks = [asyncio.ensure_future(streams.consume(insts[i % 2], i))
                 for i in range(len(PROMPTS))]
        at_drop = await streams.reached(3)
        # the dispatcher's hook on a refused reservation: 100 blocks queued for instance 0
        assert await kun.tick({0: 100}) == "drop"
        assert list(kun.controller.groups) == [HALVES]
        dropped = _states(insts)
        blocks = [inst.kv_blocks for inst in insts]
        at_restore = await streams.reached(min(at_drop) + 6)
        during = _states(insts)
        assert await kun.tick() == "restore"   # demand fell: nothing queued, usage low
        await asyncio.gather(*tasks)
        return at_drop, dropped, blocks, at_restore, during

    at_drop, dropped, blocks, at_restore, during = loop.run_until_complete(body())
    mem = kun.controller.mem
    assert all(s["lookahead"] == lookahead for s in during)
    split = [s["micro_batches"] - s["steps"] for s in during]   # > 0: a step was cut
    assert (max(split) > 0) == lookahead and min(split) >= 0, during
    # mid-generation: the slowest request (the one `reached` waits for) runs across the
    # drop and the restore; faster ones may finish first on a loaded machine
    assert min(at_drop) < MAX_TOKENS and min(at_restore) < MAX_TOKENS
    assert [s["dropped_layers"] for s in dropped] == [2, 2]
    # invariant 2: the group's blocks are the old ones plus the freed bytes over block bytes
    freed = sum(s["freed_param_bytes"] for s in dropped)
    assert freed == 4 * mem.layer_param_bytes
    assert sum(blocks) == 2 * BLOCKS + freed // mem.block_bytes > 2 * BLOCKS
    # nothing recomputed: the pipeline ran decode steps only; the slowest request at the drop
    # (on instance j % 2) decoded while dropped, so the other member ran its stage (a member
    # whose own requests all finished first on a loaded machine may have had none to serve)
    assert all(s["prefill_tokens"] == 0 for s in during)
    slowest = at_drop.index(min(at_drop))
    assert during[1 - slowest % 2]["stage_runs"] > 0, during
    assert all(s["activation_items"] >= s["stage_runs"] for s in during)
    assert all(s["exchange_bytes"] > 0 for s in during)
    assert [inst.kv_blocks for inst in insts] == [BLOCKS, BLOCKS]
    assert [s["dropped_layers"] for s in _states(insts)] == [0, 0]
    assert kun.dropped_layers() == {0: 0, 1: 0}
    for i, want in enumerate(reference):
        assert_same_run(*streams.runs[i], want, f"k{i}")


def test_a_drop_losing_a_layer_is_refused_and_changes_nothing(pool, loop):
    insts, kun = pool
    before = (list(kun.controller.groups), [inst.kv_blocks for inst in insts], _states(insts))
    for bad in ([Group((0, 1), ((0, 2), (3, 4)))],        # layer 2 would have no copy
                [Group((0, 1), ((0, 3), (2, 4)))],        # layer 2 twice
                [Group((0, 7), ((0, 2), (2, 4)))]):       # no instance 7
        with pytest.raises(DropRefused):
            loop.run_until_complete(kun.force_drop(bad))
        assert (list(kun.controller.groups), [inst.kv_blocks for inst in insts],
                _states(insts)) == before


def test_a_prefilled_request_lands_on_a_dropped_member_and_decodes_exactly(pool, loop,
                                                                         reference):
    """While dropped, a member takes a request prefilled elsewhere: its whole-model KV lands
    in the member's landing zone, each layer goes to its keeper over the link, and the
    request decodes through the pipeline (and after the restore) as the single engine."""
    insts, _ = pool
    sender = getattr(insts[0], "test_sender", None)
    if sender is None:
        pytest.skip(nixl_unavailable_reason() or "no KV transfer")
    landing = 8
    kun = ServedKunServe(insts, landing_blocks=landing)
    model, _ = load_model(MODEL)
    prompt = PROMPTS[1]
    kv = Reference.prompt_kv(types.SimpleNamespace(model=model), prompt)   # [T, 2, Hkv, D]
    want = reference[1]
    streams = Streams()

    async def body():
        await kun.start()
        tasks = [asyncio.ensure_future(streams.consume(insts[i % 2], i)) for i in (0, 2, 3)]
        while len(streams.runs) < 3 or min(len(r[0]) for r in streams.runs.values()) < 2:
            streams.changed.clear()
            await streams.changed.wait()
        await kun.force_drop([HALVES])
        blocks = [inst.kv_blocks for inst in insts]
        await insts[1].reserve("land", prompt, GREEDY_LP)
        insts[1].commit("land", want[0][0], want[1][0])
        n = len(prompt)
        await sender.send.remote("land", 1, n, 0, (0, n), kv, len(kv))
        outs = []
        async for out in insts[1].stream("land"):
            outs.append(out)
            if sum(len(o.new_token_ids) for o in outs) == 6:
                dropped = _states(insts)
                await kun.force_restore(0)
        await asyncio.gather(*tasks)
        return outs, blocks, dropped

    outs, blocks, dropped = loop.run_until_complete(body())
    mem = kun.controller.mem
    zone = 2 * landing * mem.block_bytes   # the two landing zones come out of the KV region
    assert sum(blocks) == 2 * BLOCKS + (4 * mem.layer_param_bytes - zone) // mem.block_bytes
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [e for o in outs for e in o.new_logprobs]
    assert_same_run(tokens, logprobs, want, "land")
    assert all(s["prefill_tokens"] == 0 for s in dropped)   # its prompt was not recomputed
    assert [s["landed"] for s in dropped] == [0, 1]         # landed on member 1, forwarded
    for i in (0, 2, 3):
        assert_same_run(*streams.runs[i], reference[i], f"k{i}")


def test_a_reservation_refused_for_kv_drops_a_group_and_lands_instead_of_a_429(pool, loop):
    """The decode pool's hook (``KunServePool._reserve_or_tick``): with two requests on each
    instance (30 to 48 of its 48 blocks over their life, never preempted), a 40-block prompt
    fits neither instance nor the pool's free blocks: refused (``DecodeFull``, the
    dispatcher's 429) without KunServe; with it, the controller's overload decision drops
    instances 0 and 1 into a group and the prompt lands on instance 0, then decodes as the
    single engine."""
    insts, _ = pool
    sender = getattr(insts[0], "test_sender", None)
    if sender is None:
        pytest.skip(nixl_unavailable_reason() or "no KV transfer")
    kun = ServedKunServe(insts, landing_blocks=BLOCKS)
    model, tok = load_model(MODEL)
    fillers = [_prompt(56, 20 + i) for i in range(4)]    # 15 to 24 blocks each
    big = _prompt(156, 9)                                # 40 blocks
    ref = LLMEngine(model, tok, num_blocks=256, block_size=4, max_num_seqs=8)
    want_fillers = engine_runs(ref, fillers, GREEDY_LP)
    want = engine_runs(ref, [big], GREEDY_LP, "big")[0]
    kv = Reference.prompt_kv(types.SimpleNamespace(model=model), big)
    streams = Streams(fillers)

    async def body():
        await kun.start()
        tasks = [asyncio.ensure_future(streams.consume(insts[i % 2], i)) for i in range(4)]
        await streams.reached(2)

        def reserve():
            return insts[0].reserve("big", big, GREEDY_LP)

        with pytest.raises(DecodeFull):
            await _Pool(insts, None)._reserve_or_tick(0, reserve, len(big))
        loads = kun.loads({0: 40})
        try:
            await _Pool(insts, kun)._reserve_or_tick(0, reserve, len(big))
        except DecodeFull:
            pytest.fail(f"no drop: refused {kun.refused}, refusals {kun.controller.refusals}, "
                        f"loads before {loads}, after {kun.loads({0: 40})}")
        dropped = kun.dropped_layers()
        insts[0].commit("big", want[0][0], want[1][0])
        await sender.send.remote("big", 0, len(big), 0, (0, len(big)), kv, len(kv))
        outs = [out async for out in insts[0].stream("big")]
        await asyncio.gather(*tasks)
        await kun.force_restore(0)
        return dropped, outs

    dropped, outs = loop.run_until_complete(body())
    assert dropped == {0: 2, 1: 2}
    assert_same_run([t for o in outs for t in o.new_token_ids],
                    [e for o in outs for e in o.new_logprobs], want, "big")
    for i, w in enumerate(want_fillers):
        assert_same_run(*streams.runs[i], w, f"k{i}")
    assert kun.dropped_layers() == {0: 0, 1: 0}


def test_a_member_killed_mid_pipeline_resumes_the_group_and_the_survivor_is_rebuilt_in_place(
        pool, loop):
    """Member 1 is killed mid-pipeline: the KV of its layers for every request of the group
    is gone, so all four requests (two on each member) fail with ``DecodeInstanceLost``; the
    group is let go, member 0 becomes a whole replica in its own actor (layers from the
    checkpoint, no restart) and member 1 is restarted. Each request run again as the
    dispatcher's resume path does (its prompt plus the tokens streamed so far, recomputed)
    goes on with the single engine's tokens and logprobs."""
    insts, kun = pool
    # long runs: every request is still generating when the member dies
    long = msgspec.structs.replace(GREEDY_LP, max_tokens=64)   # 36 and 44 of 48 blocks
    model, tok = load_model(MODEL)
    reference = engine_runs(LLMEngine(model, tok, num_blocks=128, block_size=4, max_num_seqs=8),
                            PROMPTS, long)
    streams = Streams()
    survivor, restarts = insts[0].ranks[0], [inst.restarts for inst in insts]
    drops = kun.controller.drops + 1   # the forced drop below

    async def body():
        tasks = [asyncio.ensure_future(streams.consume(insts[i % 2], i, long))
                 for i in range(len(PROMPTS))]
        await streams.reached(2)
        await kun.force_drop([HALVES])
        await streams.reached(4)
        ray.kill(insts[1].ranks[0])
        finished = set(streams.finished)   # no step of the group can finish one after this
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*[inst.check() for inst in insts])
        return finished, results, await kun.rebuild_after_loss()

    finished, results, rebuilt = loop.run_until_complete(body())
    lost = [i for i, r in enumerate(results) if isinstance(r, DecodeInstanceLost)]
    assert lost == [i for i in range(len(PROMPTS)) if i not in finished], results
    assert {0, 2} & set(lost), "no request of the survivor was running at the kill"
    assert rebuilt == [0] and kun.rebuilt == [0]
    # the survivor serves again: same actor, not restarted, whole model, its own blocks
    assert insts[0].broken is None and insts[0].ranks[0] is survivor
    assert [inst.restarts for inst in insts] == restarts and insts[0].rebuilds == 1
    assert insts[0].kv_blocks == BLOCKS
    assert _states(insts[:1]) == [{"held_layers": 4, "dropped_layers": 0,
                                   "total_blocks": BLOCKS, "in_group": False}]
    assert insts[1].broken is not None   # the supervisor's to restart
    # no decision while a member is down: an overload waits for it, nothing changes
    assert loop.run_until_complete(kun.tick({0: 100})) is None
    assert kun.controller.drops == drops
    assert [g.members for g in kun.controller.groups] == [(0,), (1,)]
    assert kun.dropped_layers() == {0: 0, 1: 0}
    # the resume path: each request from its prompt and the tokens its client has
    streamed = {i: list(streams.runs[i][0]) for i in range(len(PROMPTS))}
    resumed = [p + streamed[i] for i, p in enumerate(PROMPTS)]
    params = [msgspec.structs.replace(long, max_tokens=long.max_tokens - len(streamed[i]))
              for i in range(len(PROMPTS))]
    again = Streams(resumed)

    async def resume():
        await insts[1].restart()
        await asyncio.gather(*[again.consume(insts[i % 2], i, params[i])
                               for i in lost])

    loop.run_until_complete(resume())
    assert insts[0].rebuilds == 1 and insts[1].restarts == restarts[1] + 1
    for i, (tokens, logprobs) in enumerate(reference):
        k = len(streamed[i])
        assert_same_run(streamed[i], streams.runs[i][1], (tokens[:k], logprobs[:k]), f"k{i}")
        if i in lost:
            assert_same_run(*again.runs[i], (tokens[k:], logprobs[k:]), f"k{i} resumed")
    assert [s["dropped_layers"] for s in _states(insts)] == [0, 0]
    assert all(h.empty for inst in insts for h in loop.run_until_complete(inst.held()))


class _Pool(KunServePool):
    """The decode pool's KunServe half over the module's instances."""

    def __init__(self, insts, kun) -> None:
        self.instances, self.kunserve = insts, kun


class _Handle:
    """The pool's Serve handle in process: ``handle.method.remote(*args)`` awaits it."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def __getattr__(self, name):
        method = getattr(self.pool, name)
        return types.SimpleNamespace(remote=lambda *a: method(*a))


def test_admin_routes_drop_restore_refuse_and_report_dropped_layers(pool, loop):
    import httpx
    from fastapi import FastAPI

    insts, kun = pool
    app = FastAPI()
    add_kunserve_served_routes(app, _Handle(_Pool(insts, kun)))

    async def body():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            first = (await c.get("/admin/kunserve")).json()
            lost = await c.post("/admin/kunserve/drop", json={
                "groups": [[0, 1]], "layer_ranges": [[[0, 2], [3, 4]]]})
            bad = await c.post("/admin/kunserve/drop", content=b"[1")
            after_refusals = (await c.get("/admin/kunserve")).json()
            dropped = await c.post("/admin/kunserve/drop", json={"groups": [[0, 1]]})
            metrics = (await c.get("/metrics/kunserve")).text
            again = await c.post("/admin/kunserve/drop", json={"groups": [[0, 1]]})
            restored = await c.post("/admin/kunserve/restore", json={"leader": 0})
            metrics_after = (await c.get("/metrics/kunserve")).text
            return first, lost, bad, after_refusals, dropped, metrics, again, restored, \
                metrics_after

    first, lost, bad, after_refusals, dropped, metrics, again, restored, metrics_after = \
        loop.run_until_complete(body())
    assert first["enabled"] and first["dropped_layers"] == {"0": 0, "1": 0}
    assert lost.status_code == 400 and "layer" in lost.json()["error"]["message"]
    assert bad.status_code == 400
    assert after_refusals == first and [inst.kv_blocks for inst in insts] == [BLOCKS, BLOCKS]
    assert dropped.status_code == 200, dropped.text
    view = dropped.json()
    assert view["dropped_layers"] == {"0": 2, "1": 2}
    # idle instances: no request, so no KV to exchange
    assert view["groups"][0]["members"] == [0, 1]
    assert view["exchange_bytes"] == first["exchange_bytes"]
    mem = kun.controller.mem   # invariant 2 on the group's reported blocks
    assert view["groups"][0]["kv_blocks"] == 2 * BLOCKS + 4 * mem.layer_param_bytes // mem.block_bytes
    assert 'tetris:dropped_layers{instance="0"} 2.0' in metrics
    assert 'tetris:dropped_layers{instance="1"} 2.0' in metrics
    assert again.status_code == 400           # already grouped: refused, nothing changed
    assert restored.status_code == 200 and restored.json()["dropped_layers"] == {"0": 0, "1": 0}
    assert 'tetris:dropped_layers{instance="1"} 0.0' in metrics_after
    assert [s["dropped_layers"] for s in _states(insts)] == [0, 0]
