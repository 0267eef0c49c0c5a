"""Prompt token ids as they travel between Tetris processes: one int32 buffer.

A contract: imports nothing heavy (no torch, no Ray); the engine, the ingress, the dispatcher
and the actors share it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

__all__ = ["TokenIds", "compact_tokens", "token_slices"]

# A prompt between processes: ONE int32 buffer, 4 bytes a token, against ~36 for a tuple of
# Python ints (8 for the pointer, 28 for each int object past 256), which pymalloc keeps at its
# high-water mark after a burst of long prompts. ``array('i')`` rather than a numpy array:
# iterating or ``list()`` gives Python ints, so the engine, tokenizer and sampling code take it
# as they take a list (no numpy scalars leak into outputs); it pickles in-band as one bytes
# blob, so a receiver owns its copy instead of a zero-copy view pinning a Ray object; a slice
# is again a compact array.
TokenIds = array


def compact_tokens(token_ids: Iterable[int]) -> TokenIds:
    """``token_ids`` as an int32 ``array('i')``; an ``array('i')`` is returned as is (no copy).

    Raises ``ValueError`` for an id that is not an int32 integer.
    """
    if isinstance(token_ids, array) and token_ids.typecode == "i":
        return token_ids
    try:
        if hasattr(token_ids, "dtype"):   # numpy: one buffer copy, no per-element boxing
            return _from_numpy(token_ids)
        return array("i", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be int32 integers: {e}") from None


def _from_numpy(token_ids) -> TokenIds:
    import numpy as np

    ids = np.asarray(token_ids)
    if ids.size and (ids.dtype.kind not in "iu" or ids.min() < -2**31 or ids.max() >= 2**31):
        raise TypeError(f"{ids.dtype} values that are not all int32 integers")
    return array("i", np.ascontiguousarray(ids, dtype=np.int32).tobytes())


assert array("i").itemsize == 4, "array('i') must be 32-bit for the prompt buffers"


def token_slices(token_ids: TokenIds, ranges) -> TokenIds:
    """The ids at ``ranges`` (sorted half-open ``(lo, hi)`` pairs), in order, as one array."""
    out = array("i")
    for lo, hi in ranges:
        out += token_ids[lo:hi]
    return out
