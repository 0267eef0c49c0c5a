"""EMULATION of elastic decode (actors/decode/elastic_emulated.py): two emulated TP-8 decode
instances of the paper's LLaMA3-8B deployment on threads, joined by a ``SocketWorld``. A
200K-token request is mastered by instance 0 with ``[100000, 200000)``; instance 1 holds the
rest beside a batch of its own. Each step sleeps (recorded, not slept) the decode latency
model's time over the KV the instance reads: the master its own range, the holder its batch
plus the range it is asked about; each layer exchanges one TP rank's head slice of q and of
the partials in the model's dtype; every block comes back after release."""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch.distributed as dist
from tetris.actors.decode.elastic_emulated import (
    EmulatedElasticEngine,
    EmulatedElasticRows,
    make_elastic,
)
from tetris.actors.decode.elastic_link import SocketWorld
from tetris.actors.decode.emulated import EmulatedDecodeEngine

from tetris.config import load_deployment
from tetris.sampling_params import SamplingParams

ROUNDS = 4
LONG, HALF, OTHER = 200_000, 100_000, 4096


def _deployment():
    dep = load_deployment("configs/paper-llama3-8b-emulated.toml")
    return msgspec.structs.replace(dep, model=msgspec.structs.replace(
        dep.model, max_position_embeddings=2 * LONG))


def _member(me: int, dep, store, out: dict, made: bool = False) -> None:
    slept: list[float] = []
    dc, mc = dep.decode, dep.model
    kw = {"tp_size": dc.tp_size, "kv_heads": mc.num_kv_heads // dc.tp_size, "sleep": slept.append}
    if made:   # as a decode rank's engine becomes elastic when it joins a world (the served path)
        engine = make_elastic(EmulatedDecodeEngine(dep, **kw), dep)
    else:
        engine = EmulatedElasticEngine(dep, **kw)
    rows = EmulatedElasticRows(engine, me, 2, SocketWorld(store, me, 2, "127.0.0.1", 20.0))
    params = SamplingParams(max_tokens=ROUNDS + 1, temperature=0.0, ignore_eos=True)
    if me == 0:
        engine.reserve_blocks("long", [1] * LONG, params, kv_start=HALF)
        engine.commit_prefilled("long", 2)
        rows.master("long", 1, [1])
    else:
        rows.hold("long", 1, 0, 0, HALF)
        engine.reserve_blocks("own", [1] * OTHER, params)
        engine.commit_prefilled("own", 2)
    tokens, steps = 0, []
    for _ in range(ROUNDS):
        before = len(slept)
        outputs, failed = rows.round()
        assert failed == []
        tokens += sum(len(o.new_token_ids) for o in outputs)
        steps.append(sum(slept[before:]))
    rows.release("long")
    out[me] = {"steps": steps, "tokens": tokens, "layers": len(slept) // ROUNDS,
               "data": rows.counts.data, "free": engine.num_free_blocks,
               "total": engine.blocks.num_blocks, "latency": engine.latency, "tp": dc.tp_size}
    rows.link.close()


@pytest.mark.parametrize("made", [False, True], ids=["built-elastic", "made-elastic"])
def test_emulated_instances_sleep_the_kv_they_read_and_exchange_the_paper_geometry(made):
    dep = _deployment()
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=_member, args=(me, dep, store, out, made))
               for me in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert sorted(out) == [0, 1]
    mc, lat, tp = dep.model, out[0]["latency"], out[0]["tp"]
    assert out[0]["layers"] == out[1]["layers"] == mc.num_layers      # one sleep per layer
    # step r: the long request's input is token LONG + r; the master holds [HALF, LONG + r + 1)
    for r in range(ROUNDS):
        master = lat.step_time(tp, 1, LONG - HALF + r + 1)
        holder = lat.step_time(tp, 1, OTHER + r + 1 + HALF)         # own batch + the range
        assert abs(out[0]["steps"][r] - master) < 1e-12
        assert abs(out[1]["steps"][r] - holder) < 1e-12
    assert out[0]["tokens"] == out[1]["tokens"] == ROUNDS + 1       # first token + ROUNDS
    heads, dim = mc.num_heads // tp, mc.attention_head_dim          # one TP rank's slice, bf16
    assert out[0]["data"] == ROUNDS * mc.num_layers * heads * dim * 2            # q
    assert out[1]["data"] == ROUNDS * mc.num_layers * (heads * dim * 2 + heads * 4)  # out, LSE
    assert all(out[me]["free"] == out[me]["total"] for me in range(2))
