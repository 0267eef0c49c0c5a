"""The parts of TP prefill instances that need no Ray (actors/prefill/tp.py): the head-slice
worlds of one generation on one shared store, the ranks' actor options, and the instance's
KV put together from its ranks' head slices."""

from __future__ import annotations

import threading

import pytest
import torch

from tetris.actors.prefill.tp import rank_options
from tetris.actors.prefill.tp_groups import SliceWorld, concat_heads, workers_per_instance
from tetris.actors.prefill.world import free_port
from tetris.config import load_deployment

NODE = "ab" * 28   # a Ray node id: 28 bytes in hex


def _slice_worlds(instances: int, tp: int) -> dict[tuple[int, int], SliceWorld]:
    """(instance, tp_rank) -> its SliceWorld; all formed at once, ranks are threads."""
    port, worlds, errors = free_port(), {}, []

    def join(i: int, t: int) -> None:
        try:
            worlds[i, t] = SliceWorld(0, "127.0.0.1", port, i, instances, 20.0, t)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(i, t))
               for i in range(instances) for t in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    return worlds


def test_each_head_slice_is_its_own_world_ranked_by_instance():
    """Every slice's ranks exchange on the same peers and tag at the same time; each message
    lands in its own slice (the slices share one store, keyed apart)."""
    instances, tp = 2, 2
    worlds = _slice_worlds(instances, tp)
    assert {w.backend for w in worlds.values()} == {"gloo"}   # CPU ranks (collectives.py)
    got: dict = {}

    def swap(i: int, t: int) -> None:
        w, peer = worlds[i, t], 1 - i
        buf = torch.empty(4)
        works = w.exchange([(torch.full((4,), 10.0 * t + i), peer)], [(buf, peer)], tag=7)
        for work in works:
            work.wait()
        got[i, t] = buf.tolist()

    threads = [threading.Thread(target=swap, args=key) for key in worlds]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert got == {(i, t): [10.0 * t + (1 - i)] * 4 for i in range(instances) for t in range(tp)}
    for w in worlds.values():
        w.close()


def test_rank_options_split_the_instance_gpus_and_keep_its_bundle():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    bundle = object()   # the instance's PlacementGroupSchedulingStrategy
    instance = {"num_cpus": 0, "num_gpus": 2.0, "scheduling_strategy": bundle}
    rank = rank_options(instance, 2, node_id=NODE)
    assert rank == {"num_cpus": 0, "num_gpus": 1.0, "scheduling_strategy": bundle}
    assert instance["num_gpus"] == 2.0   # the instance's own options are left as they were
    assert rank_options({"num_gpus": 0.5}, 2)["num_gpus"] == 0.25   # 4 ranks on one GPU
    # no bundle (placement "none"): a follower is pinned to its leader's node, the leader free
    follower = rank_options({"num_cpus": 0}, 2, node_id=NODE)
    pin = follower["scheduling_strategy"]
    assert isinstance(pin, NodeAffinitySchedulingStrategy)
    assert (pin.node_id, pin.soft) == (NODE, False) and "num_gpus" not in follower
    assert rank_options({"num_cpus": 0}, 2) == {"num_cpus": 0}


def test_workers_per_instance_is_the_tp_size_of_a_real_model_only():
    import msgspec

    pc = msgspec.structs.replace(load_deployment("tiny-cpu.toml").prefill, tp_size=4)
    assert workers_per_instance(pc) == 4
    assert workers_per_instance(msgspec.structs.replace(pc, executor="emulated")) == 1


def test_the_instance_kv_is_its_ranks_head_slices_side_by_side():
    pos = torch.tensor([3, 4, 9])
    k = torch.randn(2, 3, 4, 8)
    v = torch.randn(2, 3, 4, 8)
    parts = [(pos, k[:, :, 2 * t:2 * t + 2], v[:, :, 2 * t:2 * t + 2]) for t in range(2)]
    got = concat_heads(parts)
    assert torch.equal(got[0], pos) and torch.equal(got[1], k) and torch.equal(got[2], v)
    with pytest.raises(RuntimeError, match="different positions"):
        concat_heads([parts[0], (torch.tensor([3, 4, 10]), *parts[1][1:])])


def test_streaming_needs_decode_ranks_a_multiple_of_the_prefill_tp():
    import msgspec

    from tetris.actors.prefill.tp_groups import check_streaming
    from tetris.errors import ConfigError

    cfg = load_deployment("tiny-cpu.toml")   # decode TP 2

    def with_tp(prefill_tp: int, decode_tp: int):
        return msgspec.structs.replace(
            cfg, prefill=msgspec.structs.replace(cfg.prefill, tp_size=prefill_tp),
            decode=msgspec.structs.replace(cfg.decode, tp_size=decode_tp))

    for prefill_tp, decode_tp in [(1, 1), (1, 2), (2, 2), (2, 4), (4, 4)]:
        check_streaming(with_tp(prefill_tp, decode_tp))
    for prefill_tp, decode_tp in [(2, 1), (2, 3), (4, 2)]:
        with pytest.raises(ConfigError, match=rf"prefill.tp_size = {prefill_tp}.* {decode_tp} TP"):
            check_streaming(with_tp(prefill_tp, decode_tp))
