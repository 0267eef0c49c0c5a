"""oneDNN-packed copies of linear weights for CPU GEMMs.

A decode step multiplies the same weights every iteration. ``F.linear`` on CPU hands a plain
row-major [out, in] weight to MKL's sgemm on every call; oneDNN (also linked into torch, and
using AVX-512 on the sandbox CPU) can hold the weight in its own blocked layout once, so each
call only streams it. On the 2-core sandbox this made the fp32 GEMMs of a small Llama about
1.5x faster at 32 rows (docs/benchmarks.md, decode section). Same fp32 math, different
summation order: results differ from ``F.linear`` by float rounding only.

A ``PackedWeight`` remembers which tensor it copied and that tensor's version counter (which
every in-place write bumps, including writes through views such as the fused q/k/v members),
so a caller can tell a stale copy from a fresh one and fall back to ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PackedWeight", "can_pack", "linear"]


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can get a packed copy here: a 2-D fp32/bf16 CPU tensor, oneDNN on."""
    return (weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedWeight:
    """A blocked copy of ``source`` [out, in], laid out for inputs of about ``batch_hint`` rows.

    The layout is tuned for the hint but correct for any number of rows.
    """

    def __init__(self, source: torch.Tensor, batch_hint: int) -> None:
        if not can_pack(source):
            raise ValueError(
                f"cannot pack a {source.dtype} weight of shape {tuple(source.shape)} on "
                f"{source.device}: packing needs a 2-D fp32/bf16 CPU tensor and oneDNN"
            )
        if batch_hint <= 0:
            raise ValueError(f"batch_hint must be positive, got {batch_hint}")
        self.source = source
        self.batch_hint = batch_hint
        self.version = source._version
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(source.detach().contiguous(),
                                                                  batch_hint)

    def fresh_for(self, weight: torch.Tensor) -> bool:
        """True iff ``weight`` is the tensor this copy was made from and is unchanged since."""
        return weight is self.source and weight._version == self.version

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dtype != self.source.dtype:
            raise ValueError(f"input dtype {x.dtype} != packed weight dtype {self.source.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none",
                                                  [], "")

    def __reduce__(self):
        # oneDNN tensors do not pickle: rebuild the copy from the source on the other side.
        return PackedWeight, (self.source, self.batch_hint)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor:
    """``F.linear(x, weight)``, through ``packed`` when it is a fresh copy of ``weight``."""
    if packed is not None and packed.fresh_for(weight) and x.dtype == weight.dtype:
        return packed(x)
    return F.linear(x, weight)
