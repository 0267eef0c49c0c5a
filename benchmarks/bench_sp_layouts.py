"""Communication time per SP layout on gloo (CPU processes), measured beside the cost model.

Each of N processes joins one ``World`` (actors/prefill/world.py, the prefill pool's gloo
world) and runs, per layer, only the transfers of a chunk's attention: the ring's N−1 block
steps (``RingAttention``'s sends), SP-NTP's two all-to-alls (``AllToAllAttention``'s) or SP-TP's
all-gather and reduce-scatter (``SpTpAttention``'s, hidden size 256), with
the tiny model's geometry (8 heads, 2 KV heads, head size 32, fp32). No attention is computed,
so this is the communication alone, the quantity ``tetris.scheduler.sp_comm.layout_time`` models
(with ``attention_s = 0``: nothing to hide behind).

The model's link constants for loopback gloo are fitted first from the ring at N = 2 (one
message per step, two sizes: latency and bandwidth), then every (layout, N, h, l) is predicted
with ``layout_time`` and measured. All processes share this machine's cores, so the model's
"per-instance bandwidth" is an idealisation; the table shows how far it holds.

    OMP_NUM_THREADS=1 python benchmarks/bench_sp_layouts.py [--repeats 5]

``--attention`` times the whole attention call instead (transfers and attention, per layer as
the executor runs it): the ring, SP-NTP, and SP-NTP pipelined over ``--micro`` micro-partitions,
side by side in one run, with the wall time each member spent waiting on transfers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp
from tetris.actors.prefill.alltoall import AllToAllAttention, head_shard
from tetris.actors.prefill.head_shards import head_shard_slices
from tetris.actors.prefill.ring import RingAttention
from tetris.actors.prefill.sptp import SpTpAttention
from tetris.actors.prefill.world import World, free_port
from tetris.actors.prefill.zigzag import zigzag_layout

from tetris.scheduler.sp_comm import CommLinks, ModelGeometry, layout_time

# The tiny model's layers and head size, with 4 KV heads so that groups of 2 and 4 divide them.
TINY = ModelGeometry(num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32)
CASES = [(0, 2048), (0, 8192), (8192, 2048), (24576, 2048)]   # (history, chunk tokens)


def _positions(n: int, h: int, l: int):
    """Members' query positions (zigzag share) and blocks (history split evenly + share)."""
    chunk = zigzag_layout(h, h + l, n)
    hist = [(r * h // n, (r + 1) * h // n) for r in range(n)]
    q = [torch.tensor([p for lo, hi in c for p in range(lo, hi)], dtype=torch.long) for c in chunk]
    blocks = [torch.cat((torch.arange(*hist[r]), q[r])) for r in range(n)]
    return q, blocks


def _barrier(world: World, rank: int, n: int) -> None:
    """Every member hears from every other before anyone starts timing."""
    works = []
    for j in range(n):
        if j != rank:
            works += [world.isend(torch.zeros(1), j, 3), world.irecv(torch.zeros(1), j, 3)]
    for w in works:
        w.wait()


def _ring_layer(ring: RingAttention, cur: torch.Tensor) -> None:
    for t in range(ring.sp_size - 1):
        works, cur = ring._post_step(cur, t)
        ring._wait(works, 0, t)


def _a2a_layer(a2a: AllToAllAttention, q, kv, g: ModelGeometry) -> None:
    n, d = a2a.sp_size, g.head_dim
    out = []
    for j in range(n):
        qh, kh = head_shard(j, n, g.num_heads, g.num_kv_heads)
        out.append(torch.cat((q[:, qh].reshape(-1), kv[:, :, kh].reshape(-1))))
    qn, kn = g.num_heads // n, g.num_kv_heads // n
    sizes = [a2a.query_positions[j].numel() * qn * d + a2a.block_positions[j].numel() * 2 * kn * d
             for j in range(n)]
    a2a._exchange(out, sizes, q.dtype, 0, 1)
    back = [torch.zeros(a2a.query_positions[j].numel() * qn * d) for j in range(n)]
    a2a._exchange(back, [q.shape[0] * qn * d] * n, q.dtype, 0, 2)


def _sptp_layer(sp: SpTpAttention, rows, kv, g: ModelGeometry) -> None:
    """SP-TP's transfers as ``SpTpAttention.attention_block`` packs them: the all-gather of
    this member's hidden rows with each head shard's history KV, then the reduce-scatter."""
    n, d, width, r = sp.sp_size, g.head_dim, g.hidden, sp.rank
    shards = [head_shard_slices(j, n, g.num_heads, g.num_kv_heads) for j in range(n)]
    n_hist = sp.history_positions[r].numel()
    out = [torch.cat((rows.reshape(-1), kv[:n_hist, :, kh].reshape(-1))) for _, kh in shards]
    my_kh = shards[r][1].stop - shards[r][1].start
    sizes = [sp.query_positions[j].numel() * width
             + sp.history_positions[j].numel() * 2 * my_kh * d for j in range(n)]
    sp._exchange(out, sizes, rows.dtype, 0, 1)
    back = [torch.zeros(i.numel() * width) for i in sp.rows_of]
    sp._exchange(back, [rows.shape[0] * width] * n, rows.dtype, 0, 2)


def _member(rank, n, port, cases, repeats, queue):
    torch.set_num_threads(1)
    world = World(0, "127.0.0.1", port, rank, n, timeout_s=120.0)
    g, group = TINY, tuple(range(n))
    results = {}
    for h, l in cases:
        q_pos, blocks = _positions(n, h, l)
        q = torch.randn(q_pos[rank].numel(), g.num_heads, g.head_dim)
        kv = torch.randn(blocks[rank].numel(), 2, g.num_kv_heads, g.head_dim)
        ring = RingAttention(group, rank, blocks, tag=1, timeout_s=120.0, link=world)
        a2a = AllToAllAttention(group, rank, q_pos, blocks, tag=2, timeout_s=120.0, link=world)
        sp = SpTpAttention(group, rank, q_pos, blocks, h, tag=5, timeout_s=120.0, link=world)
        rows = torch.randn(q_pos[rank].numel(), g.hidden)
        for name, layer in (("ring", lambda ring=ring, kv=kv: _ring_layer(ring, kv)),
                            ("a2a", lambda a2a=a2a, q=q, kv=kv: _a2a_layer(a2a, q, kv, g)),
                            ("sptp", lambda sp=sp, rows=rows, kv=kv: _sptp_layer(sp, rows, kv, g))):
            times = []
            for _ in range(repeats + 1):          # the first is a warm-up
                _barrier(world, rank, n)
                t0 = time.perf_counter()
                for _layer in range(g.num_layers):
                    layer()
                times.append(time.perf_counter() - t0)
            results[(name, h, l)] = statistics.median(times[1:])
    queue.put((rank, results))


def _attention_member(rank, n, port, cases, repeats, micro, queue):
    """Whole attention calls per layout: (median seconds, median transfer wait) per case."""
    from tetris.actors.prefill.alltoall_pipeline import PipelinedAllToAll

    torch.set_num_threads(1)
    world = World(0, "127.0.0.1", port, rank, n, timeout_s=120.0)
    g, group = TINY, tuple(range(n))
    results = {}
    for h, l in cases:
        q_pos, blocks = _positions(n, h, l)
        q = torch.randn(q_pos[rank].numel(), g.num_heads, g.head_dim)
        k = torch.randn(blocks[rank].numel(), g.num_kv_heads, g.head_dim)
        v = torch.randn_like(k)
        layouts = {
            "ring": RingAttention(group, rank, blocks, 1, 120.0, world),
            "a2a": AllToAllAttention(group, rank, q_pos, blocks, 2, 120.0, world),
            f"a2a/{micro}": PipelinedAllToAll(group, rank, q_pos, blocks, 4, 120.0, world,
                                              micro_partitions=micro),
        }
        for name, attn in layouts.items():
            times, waits = [], []
            for _ in range(repeats + 1):
                _barrier(world, rank, n)
                attn.comm_wait_s = 0.0
                t0 = time.perf_counter()
                attn(q, q_pos[rank], k, v)
                times.append(time.perf_counter() - t0)
                waits.append(attn.comm_wait_s)
            results[(name, h, l)] = (statistics.median(times[1:]), statistics.median(waits[1:]))
    queue.put((rank, results))


def measure_attention(n: int, cases, repeats: int, micro: int) -> dict:
    """Per (layout, h, l): the slowest member's (median time, its median transfer wait)."""
    got = _spawn(n, _attention_member, (cases, repeats, micro))
    return {key: max(res[key] for _, res in got) for key in got[0][1]}


def _spawn(n: int, target, args) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, n, port, *args, queue)) for r in range(n)]
    for p in procs:
        p.start()
    got = []
    while len(got) < n:
        try:
            got.append(queue.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: see whether a member died
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a member of the N = {n} run failed") from None
    for p in procs:
        p.join()
    return got


def measure(n: int, cases, repeats: int) -> dict:
    """Per (layout, h, l) the slowest member's median time over ``repeats``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, n, port, cases, repeats, queue))
             for r in range(n)]
    for p in procs:
        p.start()
    got = []
    while len(got) < n:
        try:
            got.append(queue.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: see whether a member died
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a member of the N = {n} run failed") from None
    for p in procs:
        p.join()
    return {k: max(res[k] for _, res in got) for k in got[0][1]}


def fit_links(n2: dict) -> CommLinks:
    """Latency and bandwidth from the N = 2 ring at two sizes (one message per layer)."""
    (h1, l1), (h2, l2) = (0, 2048), (0, 8192)
    b1 = (h1 + l1) / 2 * 2 * TINY.num_kv_heads * TINY.head_dim * 4
    b2 = (h2 + l2) / 2 * 2 * TINY.num_kv_heads * TINY.head_dim * 4
    t1, t2 = n2[("ring", h1, l1)] / TINY.num_layers, n2[("ring", h2, l2)] / TINY.num_layers
    bw = (b2 - b1) / max(t2 - t1, 1e-9)
    lat = max(0.0, t1 - b1 / bw)
    return CommLinks(intra_node=bw, inter_node=bw, message_latency_s=lat, bytes_per_element=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="2,4")
    ap.add_argument("--attention", action="store_true", help="time whole attention calls")
    ap.add_argument("--micro", type=int, default=4)
    args = ap.parse_args()
    if args.attention:
        cases = [(8192, 2048), (0, 8192)]
        print("whole attention call per layer, ms (transfer wait ms); slowest member's median")
        for n in map(int, args.sizes.split(",")):
            res = measure_attention(n, cases, args.repeats, args.micro)
            for h, l in cases:
                cells = "  ".join(f"{name} {res[(name, h, l)][0] * 1e3:7.1f} "
                                  f"({res[(name, h, l)][1] * 1e3:5.1f})"
                                  for name in ("ring", "a2a", f"a2a/{args.micro}"))
                print(f"N {n} h {h:>5} l {l:>5}: {cells}")
        return
    measured = {n: measure(n, CASES, args.repeats) for n in map(int, args.sizes.split(","))}
    links = fit_links(measured[2]) if 2 in measured else fit_links(measure(2, CASES, args.repeats))
    print(f"loopback gloo fit (ring, N = 2): {links.intra_node / 1e9:.2f} GB/s, "
          f"{links.message_latency_s * 1e6:.0f} µs per message")
    names = ("ring", "a2a", "sptp")
    print(f"{'N':>2} {'h':>6} {'l':>5}  " + "  ".join(
        f"{x + ' ms':>8} {'model':>7} {'ratio':>6}" for x in names)
        + f"  {'a2a/ring meas':>13} {'model':>6}  {'sptp/ring meas':>14} {'model':>6}")
    for n, res in measured.items():
        for h, l in CASES:
            row = [n, h, l]
            pred = {}
            for name in names:
                pred[name] = layout_time(name, TINY, links, [n], h, l)
                row += [res[(name, h, l)] * 1e3, pred[name] * 1e3, res[(name, h, l)] / pred[name]]
            for name in ("a2a", "sptp"):
                row += [res[(name, h, l)] / res[("ring", h, l)], pred[name] / pred["ring"]]
            print(("{:>2} {:>6} {:>5}" + "  {:>8.2f} {:>7.2f} {:>6.2f}" * 3
                   + "  {:>13.2f} {:>6.2f}  {:>14.2f} {:>6.2f}").format(*row))


if __name__ == "__main__":
    main()
