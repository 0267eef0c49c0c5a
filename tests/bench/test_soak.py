"""``tetris bench soak``: the pure parts on real values, and one short EMULATION soak."""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os

import numpy as np
import pytest

from tetris.bench import heap_probe
from tetris.bench.soak import (deployment_capacity, held_is_zero, run_soak, soak_arrivals,
                               soak_rates, verdict)
from tetris.bench.soak_memory import rss_growth
from tetris.cli.bench_soak import add_args, run
from tetris.config import load_deployment


def _reduced(tmp_path, prefill: int = 4) -> str:
    """The paper's emulated 8B cluster cut to ``prefill`` instances (nodes of 2) and one TP-2
    decode instance."""
    src = open(load_deployment("paper-llama3-8b-emulated.toml").source_path).read()
    sizes = ", ".join(str(2 ** k) for k in range(prefill.bit_length()) if 2 ** k <= prefill)
    path = tmp_path / f"reduced-{prefill}.toml"
    path.write_text(src.replace("num_instances = 16", f"num_instances = {prefill}")
                    .replace("node_size = 8", "node_size = 2")
                    .replace("sp_candidates = [1, 2, 4, 8, 16]", f"sp_candidates = [{sizes}]")
                    .replace("num_instances = 2\ntp_size = 8", "num_instances = 1\ntp_size = 2")
                    .replace("num_backends = 16", f"num_backends = {prefill}")
                    .replace("pool_size = 16", f"pool_size = {prefill}"))
    return str(path)


def test_soak_rate_is_load_times_capacity_stretched_by_the_time_scale():
    assert soak_rates(4.0, 0.7, 1.0) == pytest.approx((2.8, 2.8))
    assert soak_rates(4.0, 0.7, 10.0) == pytest.approx((2.8, 0.28))
    with pytest.raises(ValueError, match="positive"):
        soak_rates(4.0, 0.7, 0.0)


def test_growth_is_the_tail_mean_over_the_first_sample_after_warm_up():
    mib = 2 ** 20
    samples = [(0.0, 100 * mib), (2.0, 150 * mib), (3.0, 200 * mib), (5.0, 210 * mib),
               (7.0, 205 * mib), (9.0, 212 * mib)]
    # Before warm-up the 100 and 150 MiB samples do not count; (210+205+212)/3 / 200 - 1.
    assert rss_growth(samples, 3.0) == pytest.approx(209 / 200 - 1)
    assert rss_growth(samples, 3.0, tail=1) == pytest.approx(212 / 200 - 1)
    assert rss_growth(samples, 0.0) == pytest.approx(209 / 100 - 1)
    assert rss_growth(samples, 8.0) is None          # one sample after warm-up: no baseline pair


def _actor(label, growth, lost=False, restarts=0):
    return {"label": label, "growth": growth, "lost": lost, "restarts": restarts}


def test_verdict_needs_zero_failures_and_every_actor_within_five_percent():
    ok = [_actor("Ingress", 0.01), _actor("PrefillWorker[0]", 0.049), _actor("DecodeRank[0]", -0.02)]
    v = verdict(0, ok)
    assert v["passed"] and v["zero_failed"] and v["memory_growth_ok"]
    assert v["max_growth"] == pytest.approx(0.049)
    assert not verdict(1, ok)["passed"] and verdict(1, ok)["memory_growth_ok"]
    grown = verdict(0, ok + [_actor("DecodeRank[1]", 0.051)])
    assert not grown["memory_growth_ok"] and grown["max_growth"] == pytest.approx(0.051)
    lost = verdict(0, ok + [_actor("PrefillWorker[1]", 0.0, lost=True)])
    assert not lost["passed"] and lost["actors_without_verdict"] == ["PrefillWorker[1]"]
    assert not verdict(0, ok + [_actor("Ingress", 0.0, restarts=1)])["memory_growth_ok"]
    assert not verdict(0, ok + [_actor("ProxyActor", None)])["memory_growth_ok"]


def test_held_is_zero_only_when_nothing_is_left_anywhere():
    def held(inflight=0, prefill=(), receiving=(), free=64):
        rank = {"engine_requests": 0, "receiving": list(receiving), "backends_held": [],
                "free_blocks": free, "total_blocks": 64}
        rank["empty"] = not receiving and free == 64
        return {"dispatcher": {"inflight": inflight, "queue_bookings": 0, "virtual_usage": 0,
                               "virtual_requests": 0, "cleanups": 0, "relayed": 0},
                "prefill": {0: [], 1: list(prefill)}, "decode": [{"ranks": [rank]}]}

    assert held_is_zero(held())
    assert not held_is_zero(held(inflight=1))
    assert not held_is_zero(held(prefill=["r3"]))
    assert not held_is_zero(held(receiving=["r3"], free=60))


def test_arrivals_are_lazy_seeded_poisson_with_capped_outputs():
    first = list(itertools.islice(soak_arrivals("short", 2.0, 5, 16), 2000))
    assert first[:50] == list(itertools.islice(soak_arrivals("short", 2.0, 5, 16), 50))
    assert first[:50] != list(itertools.islice(soak_arrivals("short", 2.0, 6, 16), 50))
    t = np.array([r.arrival_time for r in first])
    assert np.all(np.diff(t) > 0)
    assert 2000 / t[-1] == pytest.approx(2.0, rel=0.08)       # mean rate over 2000 arrivals
    assert all(r.output_tokens == 16 for r in first)           # outputs start at 32, capped to 16
    prompts = [r.prompt_tokens for r in first]
    assert 4000 <= min(prompts) and max(prompts) <= 95000
    assert np.mean(prompts) == pytest.approx(23600, rel=0.08)
    with pytest.raises(ValueError, match="named workload"):
        next(soak_arrivals("trace.csv", 2.0, 0, 16))


def test_capacity_search_brackets_the_25x_criterion(tmp_path):
    cfg = load_deployment(_reduced(tmp_path))
    small = deployment_capacity(cfg, "short", requests=150, tol=0.05)
    cap = small["capacity_rps"]
    probes = {rate: good for rate, _p50, _p99, good in small["probes"]}
    assert probes[cap] is True
    # The rate just above the answer (within tol) was probed and broke the SLO.
    above = [r for r, good in probes.items() if r > cap and not good]
    assert above and min(above) - cap <= 0.05 + 1e-9
    for rate, p50, p99, good in small["probes"]:
        assert good == (p50 <= 25 * small["light_p50_s"] and p99 <= 25 * small["light_p99_s"])
    # Four times the prefill instances sustain a clearly higher rate.
    full = deployment_capacity(load_deployment("paper-llama3-8b-emulated.toml"), "short",
                               requests=150, tol=0.05)
    assert full["capacity_rps"] > 2 * cap


def test_soak_refuses_a_run_without_two_samples_after_warm_up_and_a_real_model(tmp_path):
    with pytest.raises(ValueError, match="two memory samples"):
        run_soak(_reduced(tmp_path), capacity=1.0, duration_s=30, warmup_s=15, sample_every_s=10)
    with pytest.raises(ValueError, match="warm-up"):
        run_soak(_reduced(tmp_path), capacity=1.0, duration_s=30, warmup_s=-1, sample_every_s=10)
    with pytest.raises(ValueError, match="emulated deployment"):
        run_soak("tiny-cpu.toml", capacity=1.0, duration_s=30, warmup_s=5, sample_every_s=10)


@pytest.mark.timeout(300)
def test_short_soak_has_no_failures_samples_every_actor_and_releases_all(serve_http, tmp_path):
    p = argparse.ArgumentParser()
    add_args(p)
    p.add_argument("--json", action="store_true")
    png = tmp_path / "rss.png"
    # Two prefill workers: each actor is a process that imports torch, which dominates startup.
    args = p.parse_args(["--config", _reduced(tmp_path, 2), "--capacity", "1.0", "--load", "0.7",
                         "--duration", "8", "--warmup", "2", "--sample-every", "2",
                         "--max-output", "4", "--drain-timeout", "60", "--plot", str(png),
                         "--trace-heap", "--json"])
    out = json.loads(json.dumps(run(args)))
    assert out["emulation"] is True and "EMULATION" in out["label"]
    assert out["rate_rps"] == pytest.approx(0.7) and out["capacity"]["source"] == "given"
    req = out["requests"]
    assert req["failed"] == 0, req["errors"]
    assert req["sent"] >= 2 and req["completed"] == req["sent"]
    assert out["ttft_s"]["p50"] > 0
    labels = {a["label"]: a for a in out["memory"]["actors"]}
    assert "PrefillWorker[2]" not in labels
    for name in ["PrefillWorker[0]", "PrefillWorker[1]", "DecodeRank[0]", "Ingress", "DispatcherServer", "PrefillPoolServer",
                 "DecodePoolServer"]:
        a = labels[name]
        assert a["samples"] >= 5 and not a["lost"] and a["restarts"] == 0, name
        assert a["rss_warm_mib"] > 10 and a["growth"] is not None and a["rss_growth"] is not None
        assert 10 < a["private_warm_mib"] < a["rss_warm_mib"]
    assert out["verdict"]["zero_failed"]
    assert out["verdict"]["max_growth"] == pytest.approx(
        max(a["growth"] for a in out["memory"]["actors"]))
    assert out["held_zero"] is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the heap reports: taken in every Tetris process (not Serve's own), with tracing on
    heap = out["memory"]["heap"]
    assert out["memory"]["heap_traced"] is True
    assert set(heap) == set(labels) - {"ServeController", "ProxyActor"}, heap
    for name, d in heap.items():
        assert "error" not in d, (name, d)
        assert np.isfinite(d["rss_mib"]) and "malloc_in_use_mib" in d and d["traced_mib"] > 0, name
        assert set(d["maps_mib"]) == set(heap_probe.MAP_KINDS), name   # (pymalloc: none when traced)


def test_private_memory_leaves_out_touched_shared_pages():
    """The soak's criterion reads the process's anonymous pages: pages of shared memory it
    touches (Ray's object store) show in its RSS but not there, while its own allocations show
    in both."""
    from multiprocessing import shared_memory

    from tetris.bench.soak_memory import _proc_memory

    mib = 2 ** 20
    rss0, private0, shared0 = _proc_memory(os.getpid())
    seg = shared_memory.SharedMemory(create=True, size=32 * mib)
    # fresh private pages, whatever malloc holds: a bytearray can reuse pages already resident
    own = mmap.mmap(-1, 32 * mib, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        seg.buf[::4096] = b"\x01" * len(seg.buf[::4096])      # touch every page
        rss1, private1, shared1 = _proc_memory(os.getpid())
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            own.madvise(mmap.MADV_NOHUGEPAGE)  # 8192 faults: huge pages have their own test
        own[::4096] = b"\x01" * len(own[::4096])
        rss2, private2, _ = _proc_memory(os.getpid())
    finally:
        own.close()
        seg.close()
        seg.unlink()
    assert shared1 - shared0 >= 30 * mib and rss1 - rss0 >= 30 * mib
    assert private1 - private0 < 4 * mib
    assert private2 - private1 >= 30 * mib and rss2 - rss1 >= 30 * mib


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="needs /proc/PID/smaps_rollup and madvise(MADV_HUGEPAGE)")
def test_private_memory_counts_memory_faulted_in_as_huge_pages():
    """32 MiB faulted in as a few huge pages (where the kernel gives them) show in the private
    figure at once: it walks the page tables, where the cheaper counters of /proc/PID/status can
    lag by up to 64 faults per thread on older kernels."""
    from tetris.bench.soak_memory import _proc_memory

    mib = 2 ** 20
    _, private0, _ = _proc_memory(os.getpid())
    own = mmap.mmap(-1, 32 * mib, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        own.madvise(mmap.MADV_HUGEPAGE)
        own[::4096] = b"\x01" * len(own[::4096])
        _, private1, _ = _proc_memory(os.getpid())
    finally:
        own.close()
    assert private1 - private0 >= 30 * mib
