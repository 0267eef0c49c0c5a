"""Prefill workers stream the KV they compute, layer by layer, to the two TP ranks of a decode
instance through NIXL (UCX) while the chunks run; nothing is left held on either side."""

from __future__ import annotations

import sys
import threading
import time

import msgspec
import pytest
import ray
import torch

from tetris.actors.prefill.messages import ChunkTask, PrefillError
from tetris.actors.transfer_pump import TRANSFER_GROUP, TransferPump
from tetris.config import ModelConfig, TransferConfig, load_deployment
from tetris.kernels.kv_pack import pack_kv
from tetris.plan import Chunk, PrefillPlan
from tetris.transfer.backends import make_agent, nixl_unavailable_reason
from tetris.transfer.block_allocator import SimpleBlockAllocator
from tetris.transfer.receive_manager import ReceiveManager
from tetris.transfer.states import RequestReady, TransferFailed

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = ModelConfig(vocab_size=272, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2)
HKV, D = MODEL.num_kv_heads, MODEL.hidden_size // MODEL.num_heads
TP = 2                          # decode TP: receiver r takes KV head r (h = 1)
BLOCK, BLOCKS = 8, 64
TRANSFER = TransferConfig(backend="nixl", num_backends=3, pool_size=3, backend_buffer_bytes=2048,
                          send_buffer_bytes=2048, bulk_chunk_bytes=2048, timeout_s=20.0)


class RankReceiver:
    """One decode TP rank's receive side: a ReceiveManager over its own cache of KV heads
    ``[rank*h, (rank+1)*h)``, driven by its own pump; ``pause`` holds incoming messages back."""

    def __init__(self, receiver_id: int, config: TransferConfig) -> None:
        self.agent = make_agent(f"decode-stream-test-{receiver_id}", backend=config.backend)
        shape = (BLOCKS, BLOCK, HKV // TP, D)
        self.cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(MODEL.num_layers)]
        self.allocator = SimpleBlockAllocator(BLOCKS)
        self.mgr = ReceiveManager(receiver_id, self.cache, self.allocator, self.agent, config)
        self.events: list = []
        self._lock = threading.Lock()
        self._held: list | None = None
        self.pump = TransferPump(self.mgr, name=f"rank-{receiver_id}", on_events=self._record).start()

    def _record(self, events) -> None:
        with self._lock:
            self.events.extend(events)

    def info(self):
        return self.agent.info()

    def connect(self, peers: dict) -> None:
        self.pump.connect(peers)

    connect_senders = connect   # what the pool calls when it replaced senders (as DecodeRank)

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def deliver_transfer(self, msgs) -> None:
        with self._lock:
            if self._held is not None:
                self._held.extend(msgs)
                return
        self.pump.deliver(msgs)

    def pause(self, paused: bool) -> None:
        with self._lock:
            held, self._held = self._held, ([] if paused else None)
        if not paused and held:
            self.pump.deliver(held)

    def reserve(self, request_id: str, prompt_tokens: int) -> bool:
        with self.pump.locked() as mgr:
            return mgr.reserve(request_id, prompt_tokens, time.monotonic())

    def outcome(self, request_id: str):
        with self._lock:
            return next((e for e in self.events if isinstance(e, (RequestReady, TransferFailed))
                         and e.request_id == request_id), None)

    def read_back(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """[L, num_tokens, 2, h, D] of positions [0, num_tokens)."""
        with self.pump.locked():
            table = torch.tensor(block_table, dtype=torch.int32)
            return pack_kv(self.cache, table, torch.arange(num_tokens), list(range(len(self.cache))))

    def give_back(self, block_table: list[int]) -> None:
        with self.pump.locked():
            self.allocator.free(block_table)   # the decode engine would own them from here

    def held(self) -> tuple[list[str], int]:
        with self.pump.locked() as mgr:
            return sorted(mgr.requests), self.allocator.num_free


class _Unreachable:
    """A sender peer whose messages are lost: its shards are never granted a backend."""

    class _Drop:
        def remote(self, msgs) -> None:
            return None

    deliver_transfer = _Drop()


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
RankReceiverActor = ray.remote(num_cpus=0, concurrency_groups={TRANSFER_GROUP: 1})(RankReceiver)


@pytest.fixture(scope="module")
def setup(ray_session):
    reason = nixl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from tetris.actors.prefill.pool import PrefillPool

    cfg = load_deployment("tiny-cpu.toml")
    dep = msgspec.structs.replace(cfg, model=MODEL, prefill=msgspec.structs.replace(
        cfg.prefill, num_instances=3, node_size=3, kv_blocks_per_instance=320))
    pool = PrefillPool(dep, timeout_s=8.0)
    ranks = [RankReceiverActor.remote(r, TRANSFER) for r in range(TP)]
    infos = pool.enable_transfer(TRANSFER)
    assert sorted(infos) == [0, 1, 2] and infos[1].name == "prefill-1"
    pool.connect_receivers({r: (ranks[r], ray.get(ranks[r].info.remote())) for r in range(TP)})
    ray.get([rk.connect.remote(dict(enumerate(pool.workers))) for rk in ranks])
    yield pool, ranks
    pool.shutdown()
    for rk in ranks:
        ray.kill(rk)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, MODEL.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _outcomes(ranks, rid, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ray.get([rk.outcome.remote(rid) for rk in ranks])
        if all(g is not None for g in got):
            return got
        time.sleep(0.05)
    raise AssertionError(f"{rid}: receivers did not finish: {got}")


def _nothing_held(pool, ranks, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        workers = pool.held_requests()
        receivers = ray.get([rk.held.remote() for rk in ranks])
        if (all(not h for h in workers.values())
                and all(not reqs and free == BLOCKS for reqs, free in receivers)):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held: workers {workers}, receivers {receivers}")
        time.sleep(0.05)


def _streams_in_full(pool, ranks, rid: str, n: int, group: tuple[int, ...], seed: int) -> None:
    """One chunk of ``n`` tokens on ``group`` reaches both receivers whole; nothing is held after."""
    assert all(ray.get([rk.reserve.remote(rid, n) for rk in ranks]))
    pool.run(PrefillPlan(rid, n, (Chunk(0, n, group),)), _prompt(n, seed), kv_receivers=tuple(range(TP)))
    ready = _outcomes(ranks, rid)
    assert all(isinstance(e, RequestReady) for e in ready), ready
    for rk, e in zip(ranks, ready):
        ray.get(rk.give_back.remote(e.block_table))
    pool.release(rid)
    _nothing_held(pool, ranks)


def _kill(actor) -> None:
    """Kill ``actor`` and wait until it is dead (``ray.kill`` only starts it: a call made
    right after may still be answered)."""
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.1)


def _reference_kv(pool, rid, n):
    """K, V [L, n, Hkv, D] of the whole prompt, gathered from the workers' stores."""
    k = torch.full((MODEL.num_layers, n, HKV, D), float("nan"))
    v = k.clone()
    for pos, kk, vv in pool.export_kv(rid).values():
        k[:, pos], v[:, pos] = kk, vv
    assert not k.isnan().any()
    return k, v



def _assert_ranks_hold(ranks, ready, ref_k, ref_v, n) -> None:
    """Each decode rank holds its head slice of the reference KV; its blocks are given back."""
    for r, (rk, e) in enumerate(zip(ranks, ready)):
        got = ray.get(rk.read_back.remote(e.block_table, n))
        heads = slice(r * HKV // TP, (r + 1) * HKV // TP)
        assert torch.equal(got[:, :, 0], ref_k[:, :, heads])
        assert torch.equal(got[:, :, 1], ref_v[:, :, heads])
        ray.get(rk.give_back.remote(e.block_table))


def _wait_sent(pool, rid: str, shards: int) -> None:
    """Until the pool's senders report ``shards`` shards of ``rid`` sent (10 s at most)."""
    deadline = time.monotonic() + 10
    while sum(st["sent"] for st in pool.transfer_state(rid).values()) < shards:
        assert time.monotonic() < deadline, pool.transfer_state(rid)
        time.sleep(0.05)

def test_streamed_kv_equals_head_slices_of_the_prefill_kv(setup):
    pool, ranks = setup
    n, rid = 150, "stream-a"
    plan = PrefillPlan(rid, n, (Chunk(0, 50, (0,)), Chunk(50, n, (0, 1, 2))))
    assert all(ray.get([rk.reserve.remote(rid, n) for rk in ranks]))
    res = pool.run(plan, _prompt(n, 1), kv_receivers=tuple(range(TP)))
    assert res.balance_moved_tokens > 0   # history moved: it must not be streamed twice
    ready = _outcomes(ranks, rid)
    assert all(isinstance(e, RequestReady) for e in ready), ready
    ref_k, ref_v = _reference_kv(pool, rid, n)
    _assert_ranks_hold(ranks, ready, ref_k, ref_v, n)
    # one shard per (chunk, member with tokens, receiver): chunk 0 on 1 member, chunk 1 on 3
    _wait_sent(pool, rid, 8)
    states = pool.transfer_state(rid)
    assert {i: st["sent"] for i, st in states.items()} == {0: 4, 1: 2, 2: 2}
    assert all(not st["failed"] for st in states.values())
    pool.release(rid)
    _nothing_held(pool, ranks)
    assert pool.transfer_state(rid) == {}


def test_a_moved_prefix_streams_from_its_new_group(setup):
    """A cached prefix moved from instance 0 to {1, 2} (``cached_moved``, prefix_move.py)
    reaches both decode ranks from {1, 2}, as prefix pseudo-chunk shards beside the chunk's
    own: the receivers admit the run with every position's KV equal to the run's stored KV,
    whose prefix is the source's bitwise; holder 0 sends nothing; nothing is held after."""
    pool, ranks = setup
    n, cached, rid = 160, 100, "moved-stream"
    ids = _prompt(n, 7)
    source = PrefillPlan("moved-stream-src", 120, (Chunk(0, 120, (0,)),))
    pool.run(source, ids[:120])
    plan = PrefillPlan(rid, n, (Chunk(cached, n, (1, 2)),), cached_tokens=cached,
                       cached_instances=(0,), cached_source=source.request_id, cached_moved=True)
    assert all(ray.get([rk.reserve.remote(rid, n) for rk in ranks]))
    pool.run(plan, ids, kv_receivers=tuple(range(TP)))
    ready = _outcomes(ranks, rid)
    assert all(isinstance(e, RequestReady) for e in ready), ready
    ref_k, ref_v = _reference_kv(pool, rid, n)
    src_k, src_v = _reference_kv(pool, source.request_id, 120)
    assert torch.equal(ref_k[:, :cached], src_k[:, :cached])
    assert torch.equal(ref_v[:, :cached], src_v[:, :cached])
    _assert_ranks_hold(ranks, ready, ref_k, ref_v, n)
    # per member of {1, 2}: its prefix share and its chunk share, to each of the 2 receivers
    _wait_sent(pool, rid, 8)
    assert {i: st["sent"] for i, st in pool.transfer_state(rid).items()} == {1: 4, 2: 4}
    for r in (rid, source.request_id):
        pool.release(r)
    _nothing_held(pool, ranks)


def test_failure_mid_stream_leaves_nothing_held(setup):
    pool, ranks = setup
    n, rid = 120, "stream-fail"
    plan = PrefillPlan(rid, n, (Chunk(0, 60, (1,)), Chunk(60, n, (1,))))
    assert all(ray.get([rk.reserve.remote(rid, n) for rk in ranks]))
    ray.get(pool.workers[1].set_fault.remote(rid, 1, 1))   # chunk 1 dies after layer 0 streamed
    with pytest.raises(PrefillError, match="FaultInjected"):
        pool.run(plan, _prompt(n, 2), kv_receivers=tuple(range(TP)))
    failed = _outcomes(ranks, rid)
    assert all(isinstance(e, TransferFailed) for e in failed), failed
    _nothing_held(pool, ranks)


def test_connecting_receivers_replaces_a_dead_worker_and_skips_a_dead_receiver(setup):
    """A decode instance restarted while a prefill worker lay dead: connecting the new receivers
    replaces the dead worker at once (it would otherwise keep the old receivers), and a receiver
    that died since its table was made is skipped, not fatal."""
    pool, ranks = setup
    replaced, old = pool.replacements, pool.workers[2]
    gone = RankReceiverActor.remote(TP, TRANSFER)
    gone_info = ray.get(gone.info.remote())
    ray.kill(gone)
    time.sleep(1.0)
    peers = {r: (ranks[r], ray.get(ranks[r].info.remote())) for r in range(TP)}
    _kill(old)
    pool.connect_receivers(peers)
    assert pool.replacements == replaced + 1 and pool.workers[2] is not old
    skipped = ray.get(pool.workers[0].connect_receivers.remote({TP: (gone, gone_info)}))
    assert skipped == [TP]     # the transfer library cannot load a dead agent: skipped, not fatal
    # the replacement streams to the receivers, and so does worker 0 after the skip
    _streams_in_full(pool, ranks, "stream-after-replace", 96, (2, 0), seed=4)


def test_heal_replaces_a_worker_that_died_idle_and_its_shards_fail_at_once(setup):
    """Worker 2 finished computing but still owed KV (its grants never reached it) when it
    died. No chunk will find it dead, so the pool's health check does; the receivers then give
    up its shards at once (not at their stall timeout), and once the request is aborted, as
    the dispatcher does with a failed one, nothing is held."""
    pool, ranks = setup
    assert pool.heal() == []                    # all alive: nothing replaced, no re-forming
    replaced, old = pool.replacements, pool.workers[2]
    n, rid = 80, "stream-died-idle"
    assert all(ray.get([rk.reserve.remote(rid, n) for rk in ranks]))
    ray.get([rk.connect.remote({2: _Unreachable()}) for rk in ranks])
    pool.run(PrefillPlan(rid, n, (Chunk(0, n, (2, 0)),)), _prompt(n, 5), kv_receivers=tuple(range(TP)))
    _kill(old)
    healed: list = []
    t0 = time.monotonic()
    healer = threading.Thread(target=lambda: healed.append(pool.heal()))
    healer.start()
    # told as soon as the worker is found dead, not once its replacement has started
    failed = _outcomes(ranks, rid)
    assert time.monotonic() - t0 < TRANSFER.timeout_s / 2
    healer.join(timeout=120)
    assert healed == [[2]]
    assert pool.replacements == replaced + 1 and pool.workers[2] is not old
    assert all(isinstance(e, TransferFailed) and "prefill instance 2 lost" in e.reason
               for e in failed), failed
    pool.abort(rid)                     # what the dispatcher does with a failed request
    _nothing_held(pool, ranks)
    _streams_in_full(pool, ranks, "stream-after-heal", n, (2, 1), seed=6)   # the successor serves


def test_abort_before_grants_tells_the_receivers(setup):
    pool, ranks = setup
    n, rid = 64, "stream-abort"
    ray.get([rk.pause.remote(True) for rk in ranks])   # no grants: shards stay unfinished
    try:
        pool.run(PrefillPlan(rid, n, (Chunk(0, n, (2, 0)),)), _prompt(n, 3),
                 kv_receivers=tuple(range(TP)))
        states = pool.transfer_state(rid)
        assert {i: st["unfinished"] for i, st in states.items()} == {0: 2, 2: 2}
        pool.abort(rid)
    finally:
        ray.get([rk.pause.remote(False) for rk in ranks])
    failed = _outcomes(ranks, rid)
    assert all(isinstance(e, TransferFailed) and "aborted" in e.reason for e in failed), failed
    _nothing_held(pool, ranks)


def test_default_group_runs_one_chunk_at_a_time_while_transfer_calls_answer(setup):
    pool, _ranks = setup
    worker = pool.workers[2]
    n = 1500
    tasks = [ChunkTask(request_id=f"solo-{j}", chunk_index=0, num_chunks=1, seq=10**6 + j,
                       group=(2,), rank=0, chunk_start=0, chunk_end=n, prompt_tokens=n,
                       chunk_positions=(((0, n),),), history=((),), token_ids=tuple(_prompt(n, j)))
             for j in range(3)]
    prepared = ray.get([worker.prepare.remote(t) for t in tasks])
    assert prepared == [None] * 3
    # All executes are queued at once: a second thread in the default group would enter a chunk
    # while another runs, which the worker refuses (RuntimeError).
    refs = [worker.execute.remote(t) for t in tasks]
    state = ray.get(worker.transfer_state.remote("solo-0"), timeout=30)   # transfer group answers
    assert state["shards"] == 0
    results = ray.get(refs)
    assert [r.request_id for r in results] == ["solo-0", "solo-1", "solo-2"]
    # run on the worker itself, not through the pool: the pool, which releases a request on its
    # plan's members only, never heard of these
    ray.get([worker.release.remote(t.request_id) for t in tasks])
    assert all(not h for h in pool.held_requests().values())


def test_emulated_worker_streams_wire_geometry_shards_and_aborts_them():
    from tetris.actors.prefill.worker import PrefillWorker

    cfg = load_deployment("tiny-cpu.toml")
    # instance 9: its in-process agent name cannot clash with another test's in this process
    worker = PrefillWorker(9, 0, cfg.model, msgspec.structs.replace(cfg.prefill, executor="emulated"),
                           profile="a100-llama3-8b-tp1")
    try:
        info = worker.enable_transfer(TransferConfig(backend="inproc"))
        assert info.name == "prefill-9" and info.backend == "inproc"
        assert worker.enable_transfer(TransferConfig(backend="inproc")) == info   # idempotent
        with pytest.raises(ValueError, match="another config"):
            worker.enable_transfer(TransferConfig(backend="inproc", timeout_s=5.0))
        task = ChunkTask(request_id="emu", chunk_index=0, num_chunks=1, seq=0, group=(9,), rank=0,
                         chunk_start=0, chunk_end=64, prompt_tokens=64, chunk_positions=(((0, 64),),),
                         history=((),), kv_receivers=(0, 1))
        worker.prepare(task)
        res = worker.execute(task)
        assert res.emulated and res.first_token is not None   # it holds the last prompt token
        # EMULATION streams like the real body: one shard per receiver (no receiver is
        # connected here, so nothing is granted and both stay unfinished until the abort).
        assert worker.transfer_state("emu") == {"shards": 2, "unfinished": 2, "sent": 0, "failed": []}
        assert worker.held_requests() == ["emu"]
        worker.abort("emu")
        assert worker.held_requests() == []
    finally:
        worker.shutdown()
