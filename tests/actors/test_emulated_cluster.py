"""EMULATION: the emulated transfer backend's timing, the emulated decode engine, and an emulated
4-prefill/1-decode deployment serving requests end to end through the Serve app."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tetris.actors.decode.emulated import (PLACEHOLDER_TOKEN, WIRE_HEAD_DIM, EmulatedDecodeEngine,
                                           decode_model_spec)
from tetris.config import TransferConfig, load_deployment
from tetris.sampling_params import SamplingParams
from tetris.scheduler.decode_latency import LLAMA3_8B, DecodeLatencyModel
from tetris.transfer.backends import make_agent
from tetris.transfer.backends.emulated import EmulatedAgent

PAPER = "paper-llama3-8b-emulated.toml"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_emulated_write_lasts_paper_bytes_over_bandwidth_and_notifies_only_then():
    clock = _Clock()
    tx = EmulatedAgent("emu-tx", bandwidth=25e9, bytes_per_wire_byte=128.0, transport="inproc",
                       clock=clock)
    rx = EmulatedAgent("emu-rx", bandwidth=25e9, bytes_per_wire_byte=128.0, transport="inproc",
                       clock=clock)
    try:
        region = rx.register(torch.empty(1 << 20, dtype=torch.uint8, device="meta"))
        tx.add_peer(rx.info())
        src = torch.zeros(1000, 2, 8, WIRE_HEAD_DIM, dtype=torch.bfloat16)   # 32,000 wire bytes
        first = tx.write(src, region, 0, b"one")
        second = tx.write(src, region, 0, b"two")   # queues behind the first on the link
        seconds = 32_000 * 128.0 / 25e9             # the paper's 4.1 MB at 25 GB/s: 164 us
        clock.now += seconds * 0.99
        assert tx.status(first) == "proc" and rx.notifications() == []
        clock.now += seconds * 0.02
        assert tx.status(first) == "done" and tx.status(second) == "proc"
        assert rx.notifications() == [("emu-tx", b"one")]
        clock.now += seconds
        assert tx.status(second) == "done" and rx.notifications() == [("emu-tx", b"two")]
        with pytest.raises(ValueError, match="overflows"):
            tx.write(torch.zeros(2 << 20, dtype=torch.uint8), region, 0, b"x")
    finally:
        tx.close()
        rx.close()


def test_make_agent_takes_the_emulated_link_from_the_transfer_config():
    cfg = TransferConfig(backend="emulated", emulated_link_bandwidth=1e9,
                         emulated_bytes_per_wire_byte=64.0)
    agent = make_agent("emu-cfg", backend="emulated", config=cfg)
    try:
        assert (agent.bandwidth, agent.bytes_per_wire_byte) == (1e9, 64.0)
        assert agent.info().backend == "emulated"
    finally:
        agent.close()
    with pytest.raises(ValueError, match="must be positive"):
        TransferConfig(emulated_link_bandwidth=0.0)


def test_decode_model_spec_of_the_paper_geometry_is_llama3_8b():
    spec = decode_model_spec(load_deployment(PAPER).model)
    assert spec.kv_bytes_per_token == LLAMA3_8B.kv_bytes_per_token
    assert spec.weight_bytes == pytest.approx(LLAMA3_8B.weight_bytes, rel=1e-3)


def test_emulated_decode_engine_batches_sleeps_the_model_time_and_emits_placeholders():
    cfg = load_deployment(PAPER)
    slept: list[float] = []
    eng = EmulatedDecodeEngine(cfg, tp_size=8, kv_heads=8, time_scale=2.0, sleep=slept.append)
    model = DecodeLatencyModel(decode_model_spec(cfg.model))
    assert eng.cache.k[0].is_meta and eng.cache.k[0].shape[-1] == WIRE_HEAD_DIM
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    slots = eng.reserve("a", [5] * 40_000, params)
    eng.reserve("b", [5] * 20_000, SamplingParams(max_tokens=2))
    assert len(slots) == 40_000 and eng.stats().receiving == 2
    free = eng.stats().free_blocks
    eng.commit_prefilled("a", PLACEHOLDER_TOKEN)
    eng.commit_prefilled("b", PLACEHOLDER_TOKEN)
    outs = eng.step()               # the first tokens, then both decode one token together
    assert slept == [2.0 * model.step_time(8, 2, 40_001 + 20_001)]
    assert [(o.request_id, len(o.token_ids)) for o in outs] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert {o.request_id for o in outs if o.finished} == {"b"}
    outs = eng.step()
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in outs] == [
        ("a", (PLACEHOLDER_TOKEN,) * 3, "length")]
    assert slept[1] == 2.0 * model.step_time(8, 1, 40_002)
    assert free < eng.stats().total_blocks
    assert not eng.has_unfinished() and eng.stats().free_blocks == eng.stats().total_blocks
    with pytest.raises(ValueError, match="does not prefill"):
        eng.add_request("c", [1, 2], params)


def _tiny_emulated(tmp_path) -> str:
    path = tmp_path / "emulated-tiny.toml"
    paper = load_deployment(PAPER)
    m = paper.model
    path.write_text(f"""
[model]
name = "emulated-tiny"
source = "dummy"
vocab_size = {m.vocab_size}
hidden_size = {m.hidden_size}
intermediate_size = {m.intermediate_size}
num_layers = 8
num_heads = {m.num_heads}
num_kv_heads = {m.num_kv_heads}
head_dim = {m.head_dim}
max_position_embeddings = 65536
dtype = "bfloat16"

[prefill]
num_instances = 4
node_size = 2
executor = "emulated"
kv_blocks_per_instance = 16

[decode]
num_instances = 1
tp_size = 2
executor = "emulated"
kv_blocks = 8192
max_batch_size = 16

[scheduler]
policy = "tetris"
sp_candidates = [1, 2, 4]
profile = "a100-llama3-8b-tp1"
improvement_rate = 0.0
min_chunk_tokens = 256

[transfer]
backend = "emulated"
num_backends = 4
pool_size = 4
timeout_s = 30.0
""")
    return str(path)


@pytest.fixture(scope="module")
def emulated_app(serve_http, tmp_path_factory):
    from ray import serve

    from tetris.serve.app import build_app

    cfg = load_deployment(_tiny_emulated(tmp_path_factory.mktemp("emu")))
    handle = serve.run(build_app(cfg), name="tetris-emulated", route_prefix="/emulated")
    serve.get_deployment_handle("DispatcherServer", "tetris-emulated").warmup.remote().result()
    yield cfg, handle
    serve.delete("tetris-emulated")


@pytest.mark.timeout(300)
def test_emulated_deployment_serves_requests_end_to_end_and_frees_everything(emulated_app):
    import asyncio
    import time

    from ray import serve

    from tetris.serve.types import GenerationRequest

    _, handle = emulated_app
    lengths = [(3000, 5), (12_000, 3), (500, 7)]

    async def run():
        async def one(n, out):
            req = GenerationRequest(prompt_token_ids=(7,) * n,
                                    sampling=SamplingParams(max_tokens=out, ignore_eos=True))
            pieces = [d async for d in handle.options(stream=True).generate_stream.remote(req)]
            return pieces
        return await asyncio.gather(*[one(n, o) for n, o in lengths])

    t0 = time.perf_counter()
    results = asyncio.run(run())
    took = time.perf_counter() - t0
    for (n, out), pieces in zip(lengths, results):
        tokens = [t for p in pieces for t in p.new_token_ids]
        assert tokens == [PLACEHOLDER_TOKEN] * out
        assert pieces[-1].finished and pieces[-1].finish_reason == "length"
    # The 12k prompt's emulated prefill alone takes the profile's time at SP <= 4.
    from tetris.scheduler.latency import load_profile

    assert took >= load_profile("a100-llama3-8b-tp1").predict(4, 0, 12_000)
    dispatcher = serve.get_deployment_handle("DispatcherServer", "tetris-emulated")
    held = None
    for _ in range(50):
        held = dispatcher.held.remote().result()
        if (held["dispatcher"]["inflight"] == 0 and not any(held["prefill"].values())
                and all(r["empty"] for inst in held["decode"] for r in inst["ranks"])):
            break
        time.sleep(0.2)
    assert held["dispatcher"] == {"inflight": 0, "queue_bookings": 0, "virtual_usage": 0,
                                  "virtual_requests": 0, "cleanups": 0, "relayed": 0}
    assert not any(held["prefill"].values())
    assert all(r["empty"] for inst in held["decode"] for r in inst["ranks"]), held
    timelines = dispatcher.timelines.remote(10).result()
    big = [t for t in timelines if t["prompt_tokens"] == 12_000][-1]
    assert big["outcome"] == "length" and big["breakdown"]["handoff_s"] >= 0
    decode = serve.get_deployment_handle("DecodePoolServer", "tetris-emulated")
    ranks = [h for _, (h, _) in sorted(decode.peers.remote().result().items())]
    import ray

    counts = ray.get([r.control_counts.remote() for r in ranks])
    # Handshakes and grants really flowed: every chunk member's shard shook hands with a rank.
    assert sum(c.get("in:Handshake", 0) for c in counts) >= len(lengths)
    assert sum(c.get("out:Grant", 0) for c in counts) >= 8 * len(lengths)
