"""Ring step time with and without micro-partitions (actors/prefill/ring_pipeline.py), side by
side in one run, on gloo with the ring's members as threads of this process.

Per case every member runs the real ``RingAttention`` and ``PipelinedRing`` (M pieces per
block) on the same random q, K, V (history + zigzag share, tiny geometry: 8 heads, 2 KV heads,
head size 64, fp32), one layer per call, alternating the variants within each repeat so that
the machine's drift hits all alike. Reported: the slowest member's median layer time, its
median wait on transfers, its thread's CPU time (the work of its attention calls, which the
load of a shared machine does not inflate as it does wall time), and pipelined / whole-block.

Two links:
- ``loopback``: gloo over 127.0.0.1 as is (transfers are memory copies; on this CPU attention
  dominates, so little is there to hide).
- ``EMULATION``: the same world behind ``ThrottledLink``, which holds each send until the bytes
  before it to the same peer have had ``bytes / bandwidth`` each (one FIFO per peer, a sleep,
  no CPU). The bandwidth is set per case so that a block's transfer takes ``C = ratio · A``
  (``--comm-ratios``), ``A`` being one member's attention to its own block, timed here first:
  ``ratio > 1`` is a transfer-bound ring, as an inter-node hop is on GPUs for zigzag shares
  below a few thousand tokens (per key row, attention costs ``4·(l/s)·Hq·d_h`` flops and the
  hop ``4·Hkv·d_h`` bytes in bf16: ``A/C = (l/s)·(Hq/Hkv)·B/F``, ~(l/s)/4000 for LLaMA3-8B at
  25 GB/s against ~400 TFLOP/s). The whole-block ring then takes ``(s−1)·max(A, C) + A`` per
  layer and the pipelined one about ``max(s·A, (s−1)·C + A/M)``: the last step's attention
  hides behind the last pieces' arrival. That model is printed beside the measurement.

    OMP_NUM_THREADS=1 python benchmarks/bench_ring_pipeline.py [--repeats 7] [--micro 2,4,8] \
        [--comm-ratios 0.5,2]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

import torch
from tetris.actors.prefill.ring import RingAttention, partial_attention
from tetris.actors.prefill.ring_pipeline import PipelinedRing
from tetris.actors.prefill.world import PeerLink, World, free_port
from tetris.actors.prefill.zigzag import zigzag_layout

HQ, HKV, D = 8, 2, 64


class ThrottledLink(PeerLink):
    """EMULATION of a link of ``bytes_per_s`` per direction in front of ``world`` (docstring)."""

    def __init__(self, world: World, bytes_per_s: float) -> None:
        self.world, self.bytes_per_s = world, bytes_per_s
        self._lanes: dict[int, queue.Queue] = {}

    def exchange(self, sends, recvs, tag):
        works = [self.world.irecv(t, p, tag) for t, p in recvs]
        for t, p in sends:
            done = _Sent()
            self._lane(p).put((t, tag, time.perf_counter(), done))
            works.append(done)
        return works

    def _lane(self, peer: int) -> queue.Queue:
        if peer not in self._lanes:
            self._lanes[peer] = queue.Queue()
            threading.Thread(target=self._carry, args=(peer, self._lanes[peer]),
                             daemon=True).start()
        return self._lanes[peer]

    def _carry(self, peer: int, lane: queue.Queue) -> None:
        free_at = 0.0
        while (item := lane.get()) is not None:
            t, tag, posted, done = item
            free_at = max(free_at, posted) + t.numel() * t.element_size() / self.bytes_per_s
            time.sleep(max(0.0, free_at - time.perf_counter()))
            try:
                self.world.isend(t, peer, tag).wait()
            finally:
                done.event.set()

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.put(None)


class _Sent:
    def __init__(self) -> None:
        self.event = threading.Event()

    def wait(self, timeout) -> bool:
        return self.event.wait(timeout.total_seconds())


def _shares(s: int, h: int, l: int):
    """Members' query positions (zigzag share of [h, h+l)) and blocks (history split evenly)."""
    chunk = zigzag_layout(h, h + l, s)
    q = [torch.tensor([p for lo, hi in c for p in range(lo, hi)], dtype=torch.long) for c in chunk]
    blocks = [torch.cat((torch.arange(r * h // s, (r + 1) * h // s), q[r])) for r in range(s)]
    return q, blocks


def _barrier(world: World, rank: int, s: int) -> None:
    works = []
    for j in range(s):
        if j != rank:
            works += [world.isend(torch.zeros(1), j, 3), world.irecv(torch.zeros(1), j, 3)]
    for w in works:
        w.wait()


def _member(rank, s, port, h, l, micros, repeats, link_bps, out):
    world = World(0, "127.0.0.1", port, rank, s, timeout_s=120.0)
    link = ThrottledLink(world, link_bps) if link_bps else world
    q_pos, blocks = _shares(s, h, l)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(q_pos[rank].numel(), HQ, D, generator=g)
    k = torch.randn(blocks[rank].numel(), HKV, D, generator=g)
    v = torch.randn_like(k)
    group = tuple(range(s))
    variants = {"whole": RingAttention(group, rank, blocks, 10, 120.0, link)}
    for i, m in enumerate(micros):
        variants[f"M={m}"] = PipelinedRing(group, rank, blocks, 11 + i, 120.0, link,
                                           micro_partitions=m)
    times = {name: [] for name in variants}
    waits = {name: [] for name in variants}
    cpus = {name: [] for name in variants}
    for rep in range(repeats + 1):           # the first is a warm-up
        order = list(variants) if rep % 2 else list(variants)[::-1]
        for name in order:
            attn = variants[name]
            _barrier(world, rank, s)
            attn.comm_wait_s = 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            attn(q, q_pos[rank], k, v)
            if rep:
                times[name].append(time.perf_counter() - t0)
                waits[name].append(attn.comm_wait_s)
                cpus[name].append(time.thread_time() - c0)
    if link_bps:
        link.close()
    out[rank] = tuple({n: statistics.median(x) for n, x in d.items()}
                      for d in (times, waits, cpus))


def own_block_attention_s(s: int, h: int, l: int) -> tuple[float, int]:
    """A: member 0's attention to its own block, alone (median of 3); the block's bytes."""
    q_pos, blocks = _shares(s, h, l)
    q = torch.randn(q_pos[0].numel(), HQ, D)
    k = torch.randn(blocks[0].numel(), HKV, D)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        partial_attention(q, q_pos[0], k, k, blocks[0])
        times.append(time.perf_counter() - t0)
    return statistics.median(times), k.numel() * 2 * k.element_size()


def run_case(s, h, l, micros, repeats, link_bps):
    """Per variant: the slowest member's (median layer seconds, its median transfer wait, its
    median CPU seconds on its own thread: the attention's work, whatever the machine's load)."""
    port, out = free_port(), [None] * s
    threads = [threading.Thread(target=_member, args=(r, s, port, h, l, micros, repeats,
                                                      link_bps, out)) for r in range(s)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(o is None for o in out):
        raise RuntimeError("a ring member failed (see its traceback above)")
    worst = {}
    for name in out[0][0]:
        r = max(range(s), key=lambda j: out[j][0][name])
        worst[name] = (out[r][0][name], out[r][1][name], out[r][2][name])
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--micro", default="2,4,8")
    ap.add_argument("--sizes", default="2,4")
    ap.add_argument("--comm-ratios", default="0.5,2",
                    help="EMULATION rows: a block's transfer time / its attention time")
    ap.add_argument("--cases", default="2048:1024,0:2048", help="history:chunk tokens, ...")
    args = ap.parse_args()
    torch.set_num_threads(1)
    micros = [int(x) for x in args.micro.split(",")]
    cases = [tuple(map(int, c.split(":"))) for c in args.cases.split(",")]
    ratios = [float(x) for x in args.comm_ratios.split(",") if float(x) > 0]
    print("ring layer time, ms (transfer wait ms; member thread's CPU ms), slowest member's "
          f"median of {args.repeats}; x = pipelined / whole-block wall time, same run")
    for s in map(int, args.sizes.split(",")):
        for h, l in cases:
            a, block_bytes = own_block_attention_s(s, h, l)
            for ratio in [0.0, *ratios]:
                bps = block_bytes / (ratio * a) if ratio else 0.0
                res = run_case(s, h, l, micros, args.repeats, bps)
                whole = res["whole"][0]
                cells = "  ".join(f"{n} {t * 1e3:6.1f} ({w * 1e3:5.1f}; {c * 1e3:5.1f}) "
                                  f"x{t / whole:5.3f}" for n, (t, w, c) in res.items())
                name = f"EMULATION C/A {ratio:g}" if ratio else "loopback"
                line = f"{name:>18} s {s} h {h:>5} l {l:>5}: {cells}"
                if ratio:
                    c = ratio * a
                    model_whole = (s - 1) * max(a, c) + a
                    model = " ".join(f"x{max(s * a, (s - 1) * c + a / m) / model_whole:5.3f}"
                                     for m in micros)
                    line += (f"  | A {a * 1e3:.0f} ms, link {bps / 1e6:.1f} MB/s; "
                             f"model M={','.join(map(str, micros))}: {model}")
                print(line, flush=True)


if __name__ == "__main__":
    main()
