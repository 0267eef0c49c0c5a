"""Whether a decode engine replays CUDA graphs, decided once at start from where it runs.

A decode step on a GPU is mostly kernel-launch overhead, which a captured graph removes
(``cuda_graphs.py``). A TP rank's step has the model's all-reduces inside: NCCL kernels are
stream work a graph captures like any other (vLLM captures its all-reduce the same way), but
gloo runs on the host, outside every stream, so a graph would replay the matmuls without the
sum. So:

- off CUDA: eager; ``cuda_graphs=True`` asked for explicitly still runs the padded graph path
  eagerly (its bucketing is tested that way);
- on CUDA, one rank, or TP ranks on an NCCL group: graphs;
- on CUDA, TP ranks on a gloo group (ranks sharing a GPU): eager.

Capturing a graph with a collective inside runs that collective during warm-up and capture, so
every TP rank must capture the same buckets in the same order; lockstep gives them that (every
rank runs the same batch plans, so each bucket is first needed in the same step everywhere).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["GraphMode", "decode_graph_mode"]


class GraphMode(NamedTuple):
    """``cuda_graphs``: what ``LLMEngine`` is given (None: its own default); ``reason``: the
    start-up log line saying which path runs and why."""

    cuda_graphs: bool | None
    reason: str


def decode_graph_mode(device: str | torch.device, tp_size: int, tp_backend: str | None,
                      requested: bool | None = None) -> GraphMode:
    """The decode path of a rank on ``device`` in a TP group of ``tp_size`` whose all-reduce
    runs on ``tp_backend`` ("nccl", "gloo"; None for one rank); ``requested``: a setting that
    forces graphs on or off (None: decide here)."""
    if requested is False:
        return GraphMode(False, "eager decode: CUDA graphs are switched off")
    if torch.device(device).type != "cuda":
        if requested:
            return GraphMode(True, "eager decode (not on CUDA): the padded graph path, run "
                                   "eagerly")
        return GraphMode(False, "eager decode: not on CUDA")
    if tp_size == 1:
        return GraphMode(True, "CUDA graphs: one rank on CUDA")
    if tp_backend == "nccl":
        return GraphMode(True, f"CUDA graphs: TP {tp_size} with the NCCL all-reduce captured "
                               "inside")
    return GraphMode(False, f"eager decode: TP {tp_size}'s all-reduce runs on "
                            f"{tp_backend or 'no NCCL group'}, which a CUDA graph cannot capture")
