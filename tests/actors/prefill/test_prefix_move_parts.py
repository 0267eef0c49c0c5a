"""The pieces of a moved prefix (actors/prefill/prefix_move.py) without Ray: G's even shares,
the layout that starts from them, the holders' read-only export and the members' import on
real paged stores (KV bitwise the source's) and on EMULATION holdings (positions), the wait
for a source still running, and a holder exporting while its default thread is inside a chunk.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
from tetris.actors.prefill.chunk_order import ChunkTickets
from tetris.actors.prefill.emulated_kv import EmulatedHoldings
from tetris.actors.prefill.kv_store import PagedKVStore
from tetris.actors.prefill.layout import plan_layout
from tetris.actors.prefill.messages import PrefillError
from tetris.actors.prefill.prefix import PREFIX_CHUNK
from tetris.actors.prefill.prefix_move import (
    export_parts,
    import_parts,
    merge_rank_parts,
    move_shares,
    positions_ranges,
)

from tetris.plan import Chunk, PrefillPlan

LAYERS, HKV, D, BS = 3, 2, 4, 8


def test_shares_are_even_contiguous_and_in_ring_order():
    assert move_shares(10, 3) == (((0, 4),), ((4, 7),), ((7, 10),))
    assert move_shares(2, 3) == (((0, 1),), ((1, 2),), ())
    assert positions_ranges([0, 1, 2, 5, 6, 9]) == ((0, 3), (5, 7), (9, 10))


def test_the_layout_starts_from_the_shares_without_balancing():
    plan = PrefillPlan("r", 130, (Chunk(100, 110, (2,)), Chunk(110, 130, (2, 3))),
                       cached_tokens=100, cached_instances=(0, 1), cached_source="s",
                       cached_moved=True).validate(4)
    layouts, final = plan_layout(plan, "overlap", {2: ((0, 100),)})
    assert layouts[0].moves == () and layouts[0].history == (((0, 100),),)
    # chunk 1 grows the group: cache balancing spreads [0, 110) over {2, 3} as between chunks
    assert sum(b - a for m in layouts[1].moves for a, b in m.positions) == 55
    assert sorted(p for i in final for a, b in final[i] for p in range(a, b)) == list(range(130))


def _worker(store=None, holdings=None, tp_rank=0, tp_size=1):
    executor = types.SimpleNamespace(fault=None, holdings=holdings)
    return types.SimpleNamespace(store=store, executor=executor, instance=0, tp_rank=tp_rank,
                                 tp_size=tp_size)


def _store() -> PagedKVStore:
    return PagedKVStore(LAYERS, num_blocks=64, block_size=BS, num_kv_heads=HKV, head_dim=D)


def test_export_is_read_only_and_import_stores_each_share_bitwise():
    torch.manual_seed(0)
    total, upto = 90, 77   # the hit ends inside a block
    k_src, v_src = torch.randn(LAYERS, total, HKV, D), torch.randn(LAYERS, total, HKV, D)
    held = {0: ((0, 20), (60, 90)), 1: ((20, 60),)}   # as a ring left the source
    holders = {}
    for i, ranges in held.items():
        store = _store()
        store.reserve("src", ranges)
        pos = torch.cat([torch.arange(a, b) for a, b in ranges])
        for layer in range(LAYERS):
            store.write("src", layer, ranges, k_src[layer, pos], v_src[layer, pos])
        holders[i] = store
    snapshot = {i: s.export("src") for i, s in holders.items()}
    shares = move_shares(upto, 3)
    answers = [export_parts(_worker(s), "src", upto, shares) for s in holders.values()]
    assert [a[0] for a in answers] == [((0, 20), (60, 77)), ((20, 60),)]
    for i, s in holders.items():   # read only: the holders' KV and blocks as before
        assert s.requests() == ["src"]
        assert all(torch.equal(a, b) for a, b in zip(snapshot[i], s.export("src")))
    for r, share in enumerate(shares):
        member = _store()
        parts = tuple(a[1 + r] for a in answers)
        assert import_parts(_worker(member), "run", share, total, upto, (), parts) == share
        pos, k, v = member.export("run")
        assert positions_ranges(pos.tolist()) == share
        assert torch.equal(k, k_src[:, pos]) and torch.equal(v, v_src[:, pos])


def test_tp_ranks_export_their_heads_and_import_their_own_slice():
    """TP 2: each rank of a holder exports its KV head; merged in rank order they are the
    instance's heads, and each rank of a member stores its own head from them."""
    torch.manual_seed(1)
    kv = torch.randn(2, LAYERS, 24, HKV, D)   # K, V of the instance's heads
    ranks = []
    for r in range(2):   # rank r holds head r only
        store = PagedKVStore(LAYERS, 16, BS, 1, D)
        store.reserve("src", ((0, 24),))
        for layer in range(LAYERS):
            store.write("src", layer, ((0, 24),), kv[0, layer, :, r:r + 1],
                        kv[1, layer, :, r:r + 1])
        ranks.append(export_parts(_worker(store, tp_rank=r, tp_size=2), "src", 20,
                                  (((0, 20),),)))
    held, part = merge_rank_parts(ranks)
    assert held == ((0, 20),) and torch.equal(part[1], kv[0, :, :20])
    assert torch.equal(part[2], kv[1, :, :20])
    for r in range(2):
        member = PagedKVStore(LAYERS, 16, BS, 1, D)
        import_parts(_worker(member, tp_rank=r, tp_size=2), "run", ((0, 20),), 30, 20, (),
                     (part,))
        _pos, k, v = member.export("run")
        assert torch.equal(k, kv[0, :, :20, r:r + 1]) and torch.equal(v, kv[1, :, :20, r:r + 1])


def test_an_import_refuses_parts_that_are_not_its_share_and_a_fault_fires():
    member = _store()
    free = member.free_blocks
    k = torch.zeros(LAYERS, 5, HKV, D)
    with pytest.raises(ValueError, match="not the share"):
        import_parts(_worker(member), "run", ((0, 6),), 10, 6, (), ((((0, 5),), k, k),))
    assert member.requests() == [] and member.free_blocks == free
    w = _worker(member)
    w.executor.fault = ("run", PREFIX_CHUNK, 1)
    with pytest.raises(RuntimeError, match="injected fault"):
        import_parts(w, "run", ((0, 5),), 10, 5, (), ((((0, 5),), k, k),))
    assert member.requests() == ["run"]   # what was written stays until the pool aborts it


def test_emulated_holders_and_members_move_positions_only():
    """EMULATION: the holdings a real store would have, no KV."""
    holdings = EmulatedHoldings()
    holdings.reserve("src", [(0, 30), (50, 70)])
    holdings.reserve("other", [(30, 50)])
    shares = move_shares(60, 2)
    held, *parts = export_parts(_worker(holdings=holdings), "src", 60, shares)
    assert held == ((0, 30), (50, 60))
    assert [p[0] for p in parts] == [((0, 30),), ((50, 60),)] and parts[0][1] is None
    member = EmulatedHoldings()
    import_parts(_worker(holdings=member), "run", shares[0], 80, 60, (), (parts[0],))
    assert member.ranges("run") == ((0, 30),) and holdings.ranges("src") == ((0, 30), (50, 70))


def test_a_move_waits_until_its_source_left_the_holders():
    tickets = ChunkTickets(4)
    source = PrefillPlan("src", 20, (Chunk(0, 10, (0,)), Chunk(10, 20, (0, 1))))
    tickets.commit(source)
    tickets.commit(PrefillPlan("run", 30, (Chunk(20, 30, (2, 3)),), cached_tokens=20,
                               cached_instances=(0, 1), cached_source="src", cached_moved=True))
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (tickets.wait_gone("src", (0, 1), 60.0),
                                              done.set()))
    waiter.start()
    tickets.chunk_done("src", 0)
    assert not done.wait(0.2)   # chunk 1 still holds 0 and 1
    tickets.chunk_done("src", 1)
    waiter.join(timeout=30)
    assert done.is_set()
    tickets.commit(PrefillPlan("late", 10, (Chunk(0, 10, (1,)),)))
    with pytest.raises(PrefillError, match="without progress"):
        tickets.wait_gone("late", (1,), 0.05)


def test_a_holder_exports_while_its_default_thread_is_inside_a_chunk(monkeypatch):
    """EMULATION worker in this process: its chunk blocks on an Event (the emulated body's
    sleep), and ``export_prefix`` (the transfer concurrency group, not the chunks' one)
    answers meanwhile; ``import_prefix`` stays in the default group, one chunk at a time."""
    import msgspec
    from tetris.actors.prefill.chunks import RunOptions, chunk_task
    from tetris.actors.prefill.worker import PrefillWorker
    from tetris.actors.transfer_pump import TRANSFER_GROUP

    from tetris.config import load_deployment

    assert PrefillWorker.export_prefix.__ray_concurrency_group__ == TRANSFER_GROUP
    assert getattr(PrefillWorker.import_prefix, "__ray_concurrency_group__", None) is None
    cfg = load_deployment("tiny-cpu.toml")
    worker = PrefillWorker(0, 0, cfg.model, msgspec.structs.replace(cfg.prefill,
                                                                    executor="emulated"),
                           profile="a100-llama3-8b-tp1")
    worker.executor.holdings.reserve("src", [(0, 64)])
    inside, go = threading.Event(), threading.Event()
    worker.executor.sleep = lambda _s: (inside.set(), go.wait(30))
    plan = PrefillPlan("busy", 512, (Chunk(0, 512, (0,)),))
    layouts, _ = plan_layout(plan)
    task = chunk_task(plan, 0, 0, layouts[0], [], 0, RunOptions("overlap", None, False, (),
                                                                None, None), 0,
                      timeout_s=10.0, emulated=True)
    worker.prepare(task)
    chunk = threading.Thread(target=worker.execute, args=(task,))
    chunk.start()
    try:
        assert inside.wait(30)
        got = []
        exporter = threading.Thread(
            target=lambda: got.append(worker.export_prefix("src", 40, (((0, 40),),))))
        exporter.start()
        exporter.join(timeout=30)   # a wait for the chunk would hang here until ``go``
        assert not exporter.is_alive() and chunk.is_alive()
        held, part = got[0]
        assert held == ((0, 40),) and part[0] == ((0, 40),)
    finally:
        go.set()
        chunk.join(timeout=30)
    assert not chunk.is_alive()
