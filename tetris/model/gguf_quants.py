"""Dequantising GGUF tensors (ggml block formats) to float32, vectorised in numpy.

A quantised ggml tensor is a sequence of fixed-size blocks, each holding ``block`` values along
the innermost dimension (a row never shares a block with the next row). Formats served here,
with the bytes of one block (all multi-byte fields little-endian, ``f16`` an IEEE half):

    F32 / F16 / BF16   1 value, plain floats (BF16: the top 16 bits of an f32)
    Q8_0   32 values,  34 B: d f16, q int8[32]                       x = d*q
    Q4_0   32 values,  18 B: d f16, nibbles[16]                       x = d*(q - 8)
    Q4_1   32 values,  20 B: d f16, m f16, nibbles[16]                x = d*q + m
    Q5_0   32 values,  22 B: d f16, high bits u32, nibbles[16]        x = d*(q - 16)
    Q5_1   32 values,  24 B: d f16, m f16, high bits u32, nibbles[16] x = d*q + m
    Q4_K  256 values, 144 B: d, dmin f16, 12 B of 6-bit scales/mins, nibbles[128]
    Q5_K  256 values, 176 B: d, dmin f16, 12 B of scales/mins, high bits[32], nibbles[128]
    Q6_K  256 values, 210 B: low nibbles[128], high 2-bit pairs[64], scales int8[16], d f16

In the 32-value formats byte j holds value j in its low nibble and value j + 16 in its high
nibble; bit j of the u32 is value j's fifth bit. The K formats are "super-blocks" of 8 (Q4_K,
Q5_K) or 16 (Q6_K) sub-blocks, each with its own scale (and min), themselves quantised
against the super-block's d (and dmin).

``dequantize(raw, kind, n_values)`` returns a flat float32 array; any other ggml type raises
``UnsupportedQuantization`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["UnsupportedQuantization", "SUPPORTED", "block_shape", "dequantize"]


class UnsupportedQuantization(ValueError):
    """A GGUF tensor uses a ggml type this loader cannot dequantise."""


def _f16(col: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n, 1] float32 (a little-endian half per row)."""
    return np.ascontiguousarray(col).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, B] packed bytes -> [n, 2B] values: all low nibbles, then all high nibbles."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1)


def _bits(words: np.ndarray, count: int) -> np.ndarray:
    """[n, 4] bytes of a little-endian u32 -> [n, count] of its bits 0..count-1."""
    w = np.ascontiguousarray(words).view("<u4").astype(np.uint32)      # [n, 1]
    return ((w >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f4").astype(np.float32)


def _f16_plain(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return _f16(b[:, :2]) * q.astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = (_nibbles(b[:, 6:]) | (_bits(b[:, 2:6], 32) << 4)).astype(np.int8) - np.int8(16)
    return _f16(b[:, :2]) * q.astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8], 32) << 4)
    return _f16(b[:, :2]) * q.astype(np.float32) + _f16(b[:, 2:4])


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K / Q5_K -> 8 six-bit scales and 8 six-bit mins, [n, 8] each.

    Sub-blocks 0-3 keep scale and min in the low 6 bits of bytes 0-3 and 4-7; sub-blocks 4-7
    take their low 4 bits from the nibbles of bytes 8-11 and their top 2 bits from the top
    bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate((lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)), axis=1)
    mins = np.concatenate((lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)), axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_quads(qs: np.ndarray) -> np.ndarray:
    """[n, 128] nibbles of a 256-value super-block -> [n, 8, 32] sub-block values.

    Each 32-byte group serves two sub-blocks: low nibbles the first, high nibbles the second.
    """
    g = qs.reshape(-1, 4, 1, 32)
    return np.concatenate((g & 0x0F, g >> 4), axis=2).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scales, mins = _k_scales_mins(b[:, 4:16])
    q = _k_quads(b[:, 16:144]).astype(np.float32)                       # [n, 8, 32]
    return ((d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]).reshape(-1, 256)


def _q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scales, mins = _k_scales_mins(b[:, 4:16])
    qh = b[:, 16:48]                                                     # [n, 32]
    # Sub-block j's fifth bits are bit j of the 32 high-bit bytes.
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1   # [n, 8, 32]
    q = (_k_quads(b[:, 48:176]) | (high << 4)).astype(np.float32)
    return ((d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]).reshape(-1, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    """Two halves of 128 values; in each, value l + 32k (l < 32, k < 4) takes its low 4 bits
    from nibble k // 2 of low byte l + 32 (k % 2) and its top 2 bits from bits 2k, 2k+1 of high
    byte l; it is scaled by the int8 scale of its 16 values."""
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)                              # [n, half, k%2, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)                            # [n, half, 1, l]
    scales = b[:, 192:208].view(np.int8).astype(np.float32)             # [n, 16]
    d = _f16(b[:, 208:210])
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=2)                  # [n, half, k, l]
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    q = (low | (((qh >> shifts) & 3) << 4)).astype(np.int8) - np.int8(32)
    q = q.astype(np.float32).reshape(-1, 16, 16)                        # 16 runs of 16 values
    return ((d * scales)[:, :, None] * q).reshape(-1, 256)


# ggml type name -> (values per block, bytes per block, block decoder [n, bytes] -> [n, values])
_FORMATS: dict[str, tuple[int, int, Callable[[np.ndarray], np.ndarray]]] = {
    "F32": (1, 4, _f32),
    "F16": (1, 2, _f16_plain),
    "BF16": (1, 2, _bf16),
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
}

SUPPORTED: tuple[str, ...] = tuple(_FORMATS)

# Blocks decoded per step: bounds the temporaries (a few float32 copies of one slice).
_BLOCKS_PER_STEP = 1 << 16


def block_shape(kind: str) -> tuple[int, int]:
    """(values, bytes) of one block of ggml type ``kind``."""
    if kind not in _FORMATS:
        raise UnsupportedQuantization(
            f"ggml type {kind} is not supported (supported: {', '.join(SUPPORTED)})")
    values, nbytes, _ = _FORMATS[kind]
    return values, nbytes


def dequantize(raw: np.ndarray, kind: str, n_values: int, *, what: str = "tensor") -> np.ndarray:
    """Raw bytes of ``n_values`` values of ggml type ``kind`` -> float32 [n_values].

    ``what`` names the tensor in errors (an unsupported type, a byte count that does not fit).
    """
    if kind not in _FORMATS:
        raise UnsupportedQuantization(
            f"{what}: ggml type {kind} is not supported "
            f"(supported: {', '.join(SUPPORTED)})")
    values, nbytes, decode = _FORMATS[kind]
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if n_values % values or data.size != n_values // values * nbytes:
        raise ValueError(f"{what}: {data.size} bytes do not hold {n_values} {kind} values "
                         f"(blocks of {values} values in {nbytes} bytes)")
    blocks = data.reshape(-1, nbytes)
    out = np.empty((blocks.shape[0], values), dtype=np.float32)
    for start in range(0, blocks.shape[0], _BLOCKS_PER_STEP):
        part = blocks[start:start + _BLOCKS_PER_STEP]
        out[start:start + part.shape[0]] = decode(part).reshape(part.shape[0], values)
    return out.reshape(-1)
