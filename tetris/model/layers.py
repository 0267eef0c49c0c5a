"""Llama building blocks: RMSNorm and rotary position embeddings with Llama-3 scaling.

Shapes use the flat token layout: T tokens, H hidden, heads x D head_dim.
"""

from __future__ import annotations

import math

import torch

from tetris.config import RopeScaling

__all__ = ["RMSNorm", "rope_inv_freq", "RotaryEmbedding"]


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalised in fp32 whatever the input dtype."""

    def __init__(self, hidden: int, eps: float, *, dtype=None, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight, as the reference Llama does, so bf16 rounding matches.
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp32), with Llama-3 frequency scaling when given.

    Llama-3 scaling (Llama 3.1 report): with L = original_max_position_embeddings, a frequency
    whose wavelength is longer than L / low_freq_factor is divided by ``factor``; one shorter
    than L / high_freq_factor is kept; in between it is interpolated linearly in L / wavelength.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError(
            f"rope_scaling.high_freq_factor ({scaling.high_freq_factor}) must exceed "
            f"low_freq_factor ({scaling.low_freq_factor})"
        )
    orig = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = orig / scaling.low_freq_factor
    high_freq_wavelen = orig / scaling.high_freq_factor
    smooth = (orig / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, interpolated, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Rotates q and k by absolute positions (the half-split layout of HF Llama checkpoints)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, *, device=None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        inv = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions LongTensor[T] -> cos, sin [T, 1, D] in ``dtype`` (angles in fp32)."""
        angles = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D]: x*cos + rotate_half(x)*sin, rotate_half(a, b) = (-b, a)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
