"""Head shards of a chunk group: which query heads, and which KV heads they read, member ``j``
of a group of ``s`` attends (SP-NTP in alltoall.py, SP-TP in sptp.py).

Member ``j`` takes query heads ``[j·Hq/s, (j+1)·Hq/s)``; under GQA query head ``h`` reads KV
head ``h // g`` with ``g = Hq/Hkv``, so the member needs KV heads ``[lo // g, (hi−1) // g + 1)``.
When ``s`` divides ``Hkv`` these are whole, disjoint KV-head shards. When ``Hkv`` divides ``s``
(e.g. 16 members over 8 KV heads), ``s/Hkv`` members share each KV head: the head is
*replicated* on them (CSPS notes §1.2: "if N exceeds the number of KV heads, KV heads must be
replicated"). Any other split would leave a member with query heads that do not map evenly onto
its KV heads, and is refused.
"""

from __future__ import annotations

__all__ = ["head_shard_slices", "head_split_problem"]


def head_split_problem(sp_size: int, num_heads: int, num_kv_heads: int) -> str:
    """Why a group of ``sp_size`` cannot split the heads, or "" when it can."""
    if num_heads % num_kv_heads:
        return f"{num_heads} heads are not a multiple of {num_kv_heads} KV heads"
    if num_heads % sp_size:
        return f"a group of {sp_size} does not divide {num_heads} heads"
    if num_kv_heads % sp_size and sp_size % num_kv_heads:
        return (f"a group of {sp_size} neither divides {num_kv_heads} KV heads nor is a "
                f"multiple of them")
    return ""


def head_shard_slices(j: int, sp_size: int, num_heads: int,
                      num_kv_heads: int) -> tuple[slice, slice]:
    """Query-head and KV-head slices member ``j`` attends (KV heads replicated when
    ``sp_size`` > ``num_kv_heads``)."""
    why = head_split_problem(sp_size, num_heads, num_kv_heads)
    if why:
        raise ValueError(f"head shards: {why}")
    hq = num_heads // sp_size
    g = num_heads // num_kv_heads
    lo, hi = j * hq, (j + 1) * hq
    return slice(lo, hi), slice(lo // g, (hi - 1) // g + 1)
