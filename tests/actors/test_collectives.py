"""The seam that picks NCCL or gloo, as behaviour on its inputs (actors/collectives.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from tetris.actors.collectives import RankDevice, StagedLink, choose_backend, peer_link
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
