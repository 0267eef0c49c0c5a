"""The seam that picks NCCL or gloo, as behaviour on its inputs (actors/collectives.py)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tetris.actors import collectives
from tetris.actors.collectives import (GroupLink, NcclLink, RankDevice, StagedLink, agree_backend,
                                       choose_backend, form_tp_group, group_link, nccl_available,
                                       pair_order, peer_link, rank_device)
from tetris.actors.prefill.world import World, free_port


def _ranks(*devices, nodes=None):
    nodes = nodes or ["n0"] * len(devices)
    return [RankDevice(n, d) for n, d in zip(nodes, devices, strict=True)]


def test_nccl_only_when_every_rank_owns_a_gpu_and_nccl_is_there():
    two_gpus = _ranks("cuda:0", "cuda:1")
    assert choose_backend(two_gpus, nccl=True) == "nccl"
    assert choose_backend(two_gpus, nccl=False) == "gloo"          # no NCCL in this build
    assert choose_backend(_ranks("cuda:0", "cpu"), nccl=True) == "gloo"   # one CPU rank
    assert choose_backend(_ranks("cpu", "cpu"), nccl=True) == "gloo"
    # two ranks on one GPU (fractional placement): NCCL refuses that, so gloo
    assert choose_backend(_ranks("cuda:0", "cuda"), nccl=True) == "gloo"
    # the same device index on two nodes is two GPUs
    assert choose_backend(_ranks("cuda:0", "cuda:0", nodes=["a", "b"]), nccl=True) == "nccl"
    with pytest.raises(ValueError):
        choose_backend([], nccl=True)


def test_cpu_links_pass_through_and_cuda_over_gloo_is_staged():
    class Link:
        pass

    link = Link()
    assert peer_link(link, "gloo", "cpu") is link
    assert peer_link(link, "nccl", "cuda:0") is link
    staged = peer_link(link, "gloo", "cuda:0")
    assert isinstance(staged, StagedLink) and staged.link is link


def test_a_staged_link_moves_cpu_tensors_unchanged_over_gloo():
    """Ranks are threads on one gloo world; CPU tensors take the plain path through the stage."""
    port, got, errors = free_port(), {}, []

    def member(rank):
        try:
            link = StagedLink(World(0, "127.0.0.1", port, rank, 2, timeout_s=20.0))
            if rank == 0:
                assert link.isend(torch.arange(6.0).reshape(2, 3), 1, 7).wait()
            else:
                buf = torch.empty(2, 3)
                assert link.irecv(buf, 0, 7).wait()
                got["buf"] = buf
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert torch.equal(got["buf"], torch.arange(6.0).reshape(2, 3))


def _in_threads(target, size):
    """Run ``target(rank)`` for every rank at once (a group forms only with all of them);
    returns {rank: result} and raises the first error."""
    out, errors = {}, []

    def run(rank):
        try:
            out[rank] = target(rank)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return out


def test_every_rank_agrees_on_the_backend_from_everyone_s_device_and_nccl():
    store = dist.HashStore()

    def agree(ranks, key):
        return _in_threads(lambda r: agree_backend(store, r, 2, ranks[r][0], ranks[r][1], key), 2)

    a, b = RankDevice("n0", "cuda:0", "GPU-a"), RankDevice("n0", "cuda:0", "GPU-b")
    # Ray gives each actor its own GPU as "cuda:0": the UUIDs tell them apart
    assert agree([(a, True), (b, True)], "k1") == {0: "nccl", 1: "nccl"}
    # one rank without NCCL: gloo on both, not NCCL on the one that has it
    assert agree([(a, True), (b, False)], "k2") == {0: "gloo", 1: "gloo"}
    # two ranks on one GPU (a fractional placement)
    assert agree([(a, True), (a, True)], "k3") == {0: "gloo", 1: "gloo"}


def test_a_cpu_world_is_formed_through_the_seam(monkeypatch):
    seen = []

    def spy(ranks, nccl):
        seen.append((tuple(ranks), nccl))
        return choose_backend(ranks, nccl)

    monkeypatch.setattr(collectives, "choose_backend", spy)
    port = free_port()
    worlds = _in_threads(lambda r: World(0, "127.0.0.1", port, r, 2, timeout_s=20.0), 2)
    cpu = rank_device("cpu")
    assert cpu.device == "cpu"
    assert seen == [((cpu, cpu), nccl_available())] * 2
    assert [w.backend for w in worlds.values()] == ["gloo", "gloo"]
    assert all(type(w._link) is GroupLink for w in worlds.values())


def test_a_gloo_world_of_cuda_members_stages_and_still_delivers_cpu_tensors():
    port = free_port()
    gpu = RankDevice("n0", "cuda:0")

    def member(rank):
        world = World(0, "127.0.0.1", port, rank, 2, timeout_s=20.0, device=gpu, nccl=False)
        assert world.backend == "gloo" and isinstance(world._link, StagedLink)
        buf = torch.full((3,), float(rank))
        works = world.exchange([(torch.full((3,), 10.0 + rank), 1 - rank)], [(buf, 1 - rank)], 5)
        assert all(w.wait() for w in works)
        return buf

    got = _in_threads(member, 2)
    assert torch.equal(got[0], torch.full((3,), 11.0))
    assert torch.equal(got[1], torch.full((3,), 10.0))


def test_group_link_by_backend_and_device():
    group = object()
    assert isinstance(group_link(group, 0, "nccl", "cuda:0"), NcclLink)
    assert type(group_link(group, 0, "gloo", "cpu")) is GroupLink
    staged = group_link(group, 0, "gloo", "cuda:1")
    assert isinstance(staged, StagedLink) and type(staged.link) is GroupLink


def _runs_to_the_end(posted: dict[int, list]) -> bool:
    """Each rank runs its operations one at a time (one NCCL stream per rank); a send and
    the receive that matches it (the next one its peer posts from it) finish together."""
    queues = {r: list(ops) for r, ops in posted.items()}
    while any(queues.values()):
        for r, q in queues.items():
            if not q:
                continue
            kind, _t, peer = q[0]
            other = queues[peer]
            want = "recv" if kind == "send" else "send"
            if other and other[0][0] == want and other[0][2] == r:
                q.pop(0)
                other.pop(0)
                break
        else:
            return False   # every rank waits on a peer that waits on something else
    return True


def test_pair_order_cannot_deadlock_where_posting_order_would():
    t = torch.zeros(1)
    # a ring of two: each member sends its block to the other and receives the other's
    ring2 = {r: ([(t, 1 - r)], [(t, 1 - r)]) for r in range(2)}
    naive = {r: [("send", t, p) for t, p in s] + [("recv", t, p) for t, p in v]
             for r, (s, v) in ring2.items()}
    assert not _runs_to_the_end(naive)
    assert _runs_to_the_end({r: pair_order(r, s, v) for r, (s, v) in ring2.items()})
    assert [k for k, _t, _p in pair_order(0, *ring2[0])] == ["send", "recv"]
    assert [k for k, _t, _p in pair_order(1, *ring2[1])] == ["recv", "send"]
    # rings of 3..5 and balancing moves both ways between several pairs, one step each
    for s in (3, 4, 5):
        step = {r: ([(t, (r + 1) % s)], [(t, (r - 1) % s)]) for r in range(s)}
        assert _runs_to_the_end({r: pair_order(r, *step[r]) for r in range(s)})
    moves = [(0, 2), (2, 0), (1, 2), (2, 1), (0, 2), (3, 1)]   # (src, dst), in plan order
    step = {r: ([(t, d) for src, d in moves if src == r], [(t, src) for src, d in moves if d == r])
            for r in range(4)}
    assert _runs_to_the_end({r: pair_order(r, *step[r]) for r in range(4)})


def test_a_tp_group_forms_through_the_seam(monkeypatch):
    seen = []
    monkeypatch.setattr(collectives, "choose_backend",
                        lambda ranks, nccl: seen.append(list(ranks)) or choose_backend(ranks, nccl))
    try:
        backend = form_tp_group("127.0.0.1", free_port(), 0, 1, 20.0, rank_device("cpu"))
        assert backend == "gloo" == dist.get_backend()
        assert seen == [[rank_device("cpu")]]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
