"""The elastic world's socket link with a tensor that is not in host memory: received through
a host copy (sockets read host bytes). No GPU here: a "meta" tensor stands for device memory
(``.numpy()`` of it raises, as it does for a CUDA tensor), so the test shows the receive no
longer reads socket bytes into the tensor's own storage."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from tetris.actors.decode.elastic_link import SocketWorld


def test_a_tensor_off_the_host_is_received_through_a_host_copy():
    store = dist.HashStore()
    worlds: list = [None, None]

    def join(i: int) -> None:
        worlds[i] = SocketWorld(store, i, 2, "127.0.0.1", timeout_s=20.0)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        sent = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        worlds[0].isend(sent, 1, 7).wait()
        worlds[0].isend(sent * 2, 1, 8).wait()
        off_host = torch.empty(3, 4, device="meta")
        worlds[1].irecv(off_host, 0, 7).wait()       # read into a host copy, then copied over
        after = torch.empty(3, 4)
        worlds[1].irecv(after, 0, 8).wait()          # the stream stayed in step
        assert torch.equal(after, sent * 2)
    finally:
        for w in worlds:
            w.close()
