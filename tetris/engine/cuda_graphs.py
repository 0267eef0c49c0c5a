"""CUDA-graph capture and replay of decode steps, one graph per batch-size bucket.

A decode step launches a few kernels per layer on tiny inputs, so on a GPU its time is mostly
launch overhead; replaying a captured graph removes it. A graph fixes its tensors' addresses
and shapes, so each bucket gets static input buffers, the live batch is copied into the first
B rows and the remaining rows are filled with each input's pad value (for example
context_lens = 0, so padding rows attend to nothing, and a slot_mapping pointing at a scratch
slot).

Lifecycle:
1. ``DecodeGraphRunner(step, inputs, batch_sizes, device)``: nothing captured yet.
2. ``capture_all()`` (largest bucket first, so smaller graphs reuse its memory pool) or lazy
   capture of a bucket the first time ``run`` needs it.
3. ``run(**tensors)``: smallest bucket >= B; copy and pad; replay; return rows [:B].

Off-GPU (or for a batch larger than every bucket) ``run`` calls the step eagerly on the given
tensors. ``emulate=True`` runs the padded static-buffer path eagerly on CPU instead, so the
bucketing and padding logic is tested without a GPU.

The step must be graph-safe: no host reads of device values (``.item()``, ``.tolist()``), no
allocation whose size depends on device data, and the same kernels every call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import torch

__all__ = ["StaticInput", "DecodeGraphRunner", "default_batch_buckets"]

StepOutput = torch.Tensor | tuple[torch.Tensor, ...]


class StaticInput(msgspec.Struct, frozen=True):
    """One batched input of the step: [B, *row_shape] of `dtype` (a torch dtype name)."""

    name: str
    row_shape: tuple[int, ...]
    dtype: str
    pad_value: float = 0

    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"input {self.name!r}: unknown torch dtype {self.dtype!r}")
        return dtype


def default_batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, all below max_batch_size, then max_batch_size itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    small = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    return small + list(range(16, max_batch_size, 16)) + [max_batch_size]


class _Bucket:
    """Static buffers of one batch size and, on a GPU, its captured graph and output."""

    def __init__(self, size: int, buffers: dict[str, torch.Tensor]) -> None:
        self.size = size
        self.buffers = buffers
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: StepOutput | None = None


class DecodeGraphRunner:
    def __init__(
        self,
        step: Callable[..., StepOutput],
        inputs: Sequence[StaticInput],
        batch_sizes: Sequence[int],
        device: torch.device | str,
        *,
        emulate: bool = False,
        warmup_iters: int = 2,
    ) -> None:
        if not batch_sizes or any(b < 1 for b in batch_sizes):
            raise ValueError(f"batch_sizes must be positive, got {list(batch_sizes)}")
        names = [spec.name for spec in inputs]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"inputs need distinct names, got {names}")
        for spec in inputs:
            spec.torch_dtype()
        self.step = step
        self.inputs = list(inputs)
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" and torch.cuda.is_available()
        self.emulate = emulate and not self.use_graphs
        self.warmup_iters = warmup_iters
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest bucket holding batch_size rows, or None when it fits none."""
        return next((b for b in self.batch_sizes if b >= batch_size), None)

    def captured(self) -> list[int]:
        return sorted(b for b, bucket in self._buckets.items() if bucket.graph is not None)

    def capture_all(self) -> None:
        """Capture every bucket, largest first so later graphs share the first one's memory pool."""
        for size in reversed(self.batch_sizes):
            self._bucket(size)

    def run(self, **tensors: torch.Tensor) -> StepOutput:
        """One decode step on a live batch [B, ...]; returns the step's output rows [:B]."""
        batch = self._check(tensors)
        size = self.bucket_for(batch)
        if size is None or not (self.use_graphs or self.emulate):
            return self.step(**tensors)
        bucket = self._bucket(size)
        self._fill(bucket, tensors, batch)
        if bucket.graph is not None:
            bucket.graph.replay()
            output = bucket.output
        else:  # emulation: the same padded static buffers, run eagerly
            output = self.step(**bucket.buffers)
        # Clone: the next replay overwrites the static output in place.
        if isinstance(output, torch.Tensor):
            return output[:batch].clone()
        return tuple(o[:batch].clone() for o in output)

    def _check(self, tensors: dict[str, torch.Tensor]) -> int:
        expected = sorted(spec.name for spec in self.inputs)
        if sorted(tensors) != expected:
            raise ValueError(f"decode step inputs are {expected}, got {sorted(tensors)}")
        sizes = {t.shape[0] if t.dim() else -1 for t in tensors.values()}
        if len(sizes) != 1 or -1 in sizes:
            shapes = {name: tuple(t.shape) for name, t in sorted(tensors.items())}
            raise ValueError(f"inputs must share a leading batch dim, got {shapes}")
        for spec in self.inputs:
            t = tensors[spec.name]
            if tuple(t.shape[1:]) != spec.row_shape or t.dtype != spec.torch_dtype():
                raise ValueError(
                    f"input {spec.name!r} must be [B, {', '.join(map(str, spec.row_shape))}] "
                    f"{spec.dtype}; got {tuple(t.shape)} {t.dtype}"
                )
        return sizes.pop()

    def _fill(self, bucket: _Bucket, tensors: dict[str, torch.Tensor], batch: int) -> None:
        for spec in self.inputs:
            buf = bucket.buffers[spec.name]
            buf[:batch].copy_(tensors[spec.name], non_blocking=True)
            buf[batch:].fill_(spec.pad_value)

    def _bucket(self, size: int) -> _Bucket:
        bucket = self._buckets.get(size)
        if bucket is None:
            buffers = {
                spec.name: torch.full((size, *spec.row_shape), spec.pad_value,
                                      dtype=spec.torch_dtype(), device=self.device)
                for spec in self.inputs
            }
            bucket = _Bucket(size, buffers)
            if self.use_graphs:
                self._capture(bucket)
            self._buckets[size] = bucket
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        # Warm up on a side stream first: lazy initialisation (Triton compilation, cuBLAS
        # workspaces) must not happen inside the capture.
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                self.step(**bucket.buffers)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.output = self.step(**bucket.buffers)
        self._pool = graph.pool()
        bucket.graph = graph
