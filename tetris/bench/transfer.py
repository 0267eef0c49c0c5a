"""Transfer benchmark: NIXL write throughput between two Ray actors next to an in-process
``torch`` copy of the same bytes, and the handshake overhead per request through Ray.

Both sides of each ratio are measured in the same run. Used by ``tetris bench transfer``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from tetris.config import TransferConfig
from tetris.transfer.backends import make_agent
from tetris.transfer.endpoints import ReceiverEndpoint, SenderEndpoint
from tetris.transfer.messages import AgentInfo, Grant, RegionDesc

__all__ = ["run_transfer_bench", "WriteTarget", "Writer"]

MiB = 1 << 20


class WriteTarget:
    """Holds a registered destination buffer of ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        self.agent = make_agent("bench-target", backend="nixl")
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.region = self.agent.register(self.buffer)

    def info(self) -> tuple[AgentInfo, RegionDesc]:
        return self.agent.info(), self.region

    def notifications(self) -> int:
        return len(self.agent.notifications())

    def checksum(self, nbytes: int) -> int:
        return int(self.buffer[:nbytes].to(torch.int64).sum())


class Writer:
    """Writes ``nbytes`` of a registered source into the target and times it (post to done)."""

    def __init__(self, nbytes: int) -> None:
        self.agent = make_agent("bench-writer", backend="nixl")
        g = torch.Generator().manual_seed(0)
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        self.agent.register(self.src)

    def connect(self, info: AgentInfo) -> None:
        self.agent.add_peer(info)

    def timed_writes(self, region: RegionDesc, nbytes: int, iters: int) -> list[float]:
        times = []
        for i in range(iters):
            t0 = time.perf_counter()
            handle = self.agent.write(self.src[:nbytes], region, 0, b"w%d" % i)
            while (status := self.agent.status(handle)) == "proc":
                pass
            times.append(time.perf_counter() - t0)
            self.agent.release(handle)
            if status != "done":
                raise RuntimeError(f"NIXL write {i} of {nbytes} B failed")
        return times

    def checksum(self, nbytes: int) -> int:
        return int(self.src[:nbytes].to(torch.int64).sum())


def _torch_copy_seconds(nbytes: int, iters: int) -> list[float]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def _throughput(ray, sizes_mib: Sequence[int], iters: int, tick: Callable[[], None]) -> list[dict]:
    largest = max(sizes_mib) * MiB
    target = ray.remote(num_cpus=0)(WriteTarget).remote(largest)
    writer = ray.remote(num_cpus=0)(Writer).remote(largest)
    info, region = ray.get(target.info.remote())
    ray.get(writer.connect.remote(info))
    rows = []
    for mib in sizes_mib:
        nbytes = mib * MiB
        ray.get(writer.timed_writes.remote(region, nbytes, 1))   # warm-up: connection setup
        nixl = statistics.median(ray.get(writer.timed_writes.remote(region, nbytes, iters)))
        if ray.get(writer.checksum.remote(nbytes)) != ray.get(target.checksum.remote(nbytes)):
            raise RuntimeError(f"bytes differ after the {mib} MiB NIXL write")
        copy = statistics.median(_torch_copy_seconds(nbytes, iters))
        rows.append({"size_mib": mib, "nixl_gib_s": nbytes / nixl / 2**30, "torch_copy_gib_s": nbytes / copy / 2**30,
                     "nixl_over_copy": copy / nixl, "nixl_ms": nixl * 1e3, "torch_copy_ms": copy * 1e3})
        tick()
    for actor in (writer, target):
        ray.kill(actor)
    return rows


def _handshake_overhead(ray, requests: int, tick: Callable[[], None]) -> dict:
    """Per request: Handshake + LayersReady from the sender through the owner to the receiver,
    Grant back: three Ray calls (sender step, receiver step, sender step) per round trip."""
    config = TransferConfig(num_backends=1, pool_size=1, backend_buffer_bytes=1 << 16, send_buffer_bytes=1 << 16,
                            bulk_chunk_bytes=1 << 16)
    receiver = ray.remote(num_cpus=0)(ReceiverEndpoint).remote(0, config, num_layers=1, num_blocks=4 * requests,
                                                               block_size=16, kv_heads=1, head_dim=8)
    sender = ray.remote(num_cpus=0)(SenderEndpoint).remote(0, config)
    ray.get(sender.add_peer.remote(ray.get(receiver.info.remote())))
    kv = torch.zeros(16, 2, 1, 8)
    times = []
    for r in range(requests):
        rid = f"hs{r}"
        # steps 1 and 4 happen inside the prefill worker anyway: not part of the overhead
        ray.get(sender.add_shard.remote(request_id=rid, chunk_index=0, receiver_id=0, prompt_tokens=16, chunk=(0, 16),
                                        ranges=[(0, 16)], num_layers=1, kv_heads=1, head_dim=8, dtype=torch.float32))
        ray.get(sender.layer_ready.remote(rid, 0, 0, kv))
        t0 = time.perf_counter()
        _, envs = ray.get(sender.step.remote([]))                       # handshake out
        _, replies = ray.get(receiver.step.remote([e.msg for e in envs]))  # grant back
        grants = [e.msg for e in replies if isinstance(e.msg, Grant) and e.msg.request_id == rid]
        _, envs = ray.get(sender.step.remote(grants))                   # grant in, first write posted
        times.append(time.perf_counter() - t0)
        if not grants:
            raise RuntimeError(f"no grant for {rid}")
        deadline = time.monotonic() + 30
        while True:   # finish the request (untimed) so that the next one finds the backend free
            events, _ = ray.get(receiver.step.remote([e.msg for e in envs]))
            if any(type(e).__name__ == "RequestReady" for e in events):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{rid} did not complete")
            _, envs = ray.get(sender.step.remote([]))
        tick()
    for actor in (sender, receiver):
        ray.kill(actor)
    return {"requests": requests, "ray_calls_per_handshake": 3, "mean_us": statistics.mean(times) * 1e6,
            "median_us": statistics.median(times) * 1e6}


def run_transfer_bench(sizes_mib: Sequence[int], iters: int, requests: int,
                       tick: Callable[[], None] = lambda: None) -> dict:
    """Starts Ray if needed (local, no dashboard) and returns one JSON-able dict."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        rows = _throughput(ray, sizes_mib, iters, tick)
        handshake = _handshake_overhead(ray, requests, tick)
    finally:
        if started:
            ray.shutdown()
    return {"bench": "transfer", "backend": "nixl-ucx", "device": "cpu", "iters": iters,
            "throughput": rows, "handshake": handshake}
