"""Activation latency while a bulk KV transfer shares the link, with and without priority.

    python benchmarks/bench_activation_priority.py [--bulk-mib 1024] [--chunk-kib 64]
        [--act-kib 64] [--interval-us 300] [--repeats 3]

The link is a Unix socket pair between this process (a ``PriorityLink`` sender thread, and
the main thread submitting one activation every ``interval``) and a receiver process that
timestamps each activation's arrival (CLOCK_MONOTONIC, shared by both processes). Three
scenarios, each ``repeats`` times, side by side in one run: ``idle`` (activations alone),
``priority`` (a bulk transfer of ``bulk-mib`` cut into ``chunk-kib`` chunks, activations go
first at every chunk boundary) and ``fifo`` (the same bulk, one queue in submit order).
Activations are sent only while the bulk is on the wire (as many in ``idle``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time

import numpy as np
from tetris.transfer.priority_link import PriorityLink, receive_chunks
from tetris.transfer.traffic import TrafficClass


def _receiver(sock: socket.socket, chunk_bytes: int, conn) -> None:
    arrivals = {}
    buf = bytearray(chunk_bytes)
    for item, _off, _n, cls, last in receive_chunks(sock, buf):
        if cls == TrafficClass.ACTIVATION and last:
            arrivals[item] = time.monotonic_ns()
    conn.send(arrivals)


def _scenario(kind: str, args, n_act: int | None) -> tuple[np.ndarray, float]:
    ctx = mp.get_context("fork")
    a, b = socket.socketpair()
    parent, child = ctx.Pipe()
    chunk = args.chunk_kib << 10
    # The kernel's socket buffers are a FIFO the scheduler cannot reorder: keep them about
    # one chunk, so what the link has accepted is what is on the wire (as with RDMA, where
    # one chunk is posted at a time). Same buffers in every scenario.
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, chunk)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, chunk)
    proc = ctx.Process(target=_receiver, args=(b, max(chunk, args.act_kib << 10), child))
    proc.start()
    b.close()
    bulk_done, sent_at = [], {}

    def on_sent(item, last):
        if last:
            sent_at[item] = time.monotonic_ns()
            if item == 0 and kind != "idle":
                bulk_done.append(1)
    link = PriorityLink(a, chunk, fifo=kind == "fifo", on_sent=on_sent)
    act = bytes(args.act_kib << 10)
    link.start()
    t0 = time.monotonic_ns()
    if kind != "idle":
        link.submit("bulk", memoryview(bytearray(args.bulk_mib << 20)), TrafficClass.BULK)
    submitted = {}
    interval = args.interval_us * 1000
    k = 0
    while (not bulk_done) if kind != "idle" else k < n_act:
        wait = t0 + k * interval - time.monotonic_ns()
        if wait > 0:      # pacing; sleeping releases the GIL for the sender thread
            time.sleep(wait / 1e9)
        item = link.submit(f"act{k}", act, TrafficClass.ACTIVATION)
        submitted[item] = time.monotonic_ns()
        k += 1
    link.close()
    elapsed = (time.monotonic_ns() - t0) / 1e9
    a.shutdown(socket.SHUT_WR)
    arrivals = parent.recv()
    proc.join()
    a.close()
    lat = np.array([(arrivals[i] - t) / 1e3 for i, t in submitted.items()])   # us
    wire = np.array([(sent_at[i] - t) / 1e3 for i, t in submitted.items()])  # until sent
    return lat, wire, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bulk-mib", type=int, default=1024)
    ap.add_argument("--chunk-kib", type=int, default=64)
    ap.add_argument("--act-kib", type=int, default=64)
    ap.add_argument("--interval-us", type=float, default=300.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"bulk={args.bulk_mib} MiB chunk={args.chunk_kib} KiB activation={args.act_kib} KiB "
          f"every {args.interval_us:g} us, unix socket pair, {args.repeats} repeats")
    print("latency: submit -> arrival at the receiver process; sent: submit -> the link's send "
          "of its last byte returned (what the scheduler controls)")
    print(f"{'run':>3} {'scenario':<9} {'n':>5} {'P50 us':>9} {'P99 us':>9} "
          f"{'P99/idle':>9} {'sent P99':>9} {'/idle':>7} {'bulk GB/s':>10}")
    for rep in range(args.repeats):
        rows = {}
        for kind in ("priority", "fifo"):
            rows[kind] = _scenario(kind, args, None)
        n = min(len(rows["priority"][0]), len(rows["fifo"][0]))
        rows = {"idle": _scenario("idle", args, n), **rows}
        idle99 = np.percentile(rows["idle"][0], 99)
        wire99 = np.percentile(rows["idle"][1], 99)
        for kind, (lat, wire, secs) in rows.items():
            rate = "" if kind == "idle" else f"{(args.bulk_mib << 20) / secs / 1e9:>10.2f}"
            print(f"{rep:>3} {kind:<9} {lat.size:>5} {np.percentile(lat, 50):>9.1f} "
                  f"{np.percentile(lat, 99):>9.1f} {np.percentile(lat, 99) / idle99:>8.2f}x "
                  f"{np.percentile(wire, 99):>9.1f} {np.percentile(wire, 99) / wire99:>6.2f}x "
                  f"{rate}")


if __name__ == "__main__":
    main()
