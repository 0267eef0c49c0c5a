"""Cache balancing between chunks (paper §4.1, Fig. 5; SPEC §6).

Before chunk ``k+1`` runs on ``G_{k+1} ⊇ G_k``, the history ``[0, start_{k+1})`` held by the
members of ``G_k`` is spread evenly over ``G_{k+1}``. ``plan_balance`` decides the moves with as
little traffic as possible; ``LayerBalancer`` runs them layer by layer on the worker side:
layer ``i+1``'s moves are issued right after layer ``i``'s ring attention and waited for just
before layer ``i+1``'s, so they run while layer ``i``'s MLP computes (paper Fig. 6-b).

Minimal movement: the even targets differ by at most one token; the one-token extras go to the
members that already hold the most, so the traffic is exactly the total surplus
``sum(max(0, held_r - target_r))``, the least any even redistribution can move. Old members then
only send and new members only receive, except in tiny histories where an old member's share
already fell below the new even share (it then receives a few tokens from another old member).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from tetris.actors.prefill.messages import Move
from tetris.actors.prefill.world import DefaultWorld, PeerLink
from tetris.actors.prefill.zigzag import Ranges, normalize_ranges, ranges_len

__all__ = ["plan_balance", "take_tail", "LayerBalancer", "BALANCE_TAG_KIND"]

BALANCE_TAG_KIND = 1


def take_tail(ranges: Ranges, n: int) -> tuple[Ranges, Ranges]:
    """Split off the last ``n`` positions: ``(kept, taken)``."""
    if n < 0 or n > ranges_len(ranges):
        raise ValueError(f"cannot take {n} positions from {ranges_len(ranges)}")
    kept = list(ranges)
    taken: list[tuple[int, int]] = []
    while n > 0:
        lo, hi = kept.pop()
        k = min(n, hi - lo)
        taken.append((hi - k, hi))
        if hi - k > lo:
            kept.append((lo, hi - k))
        n -= k
    return normalize_ranges(kept), normalize_ranges(taken)


def even_targets(held: list[int], total: int) -> list[int]:
    """Per-member even shares; the +1 extras go to the largest holders (least movement)."""
    s = len(held)
    base, extra = divmod(total, s)
    order = sorted(range(s), key=lambda r: (-held[r], r))
    targets = [base] * s
    for r in order[:extra]:
        targets[r] += 1
    return targets


def plan_balance(
    held: list[Ranges], group: tuple[int, ...]
) -> tuple[tuple[Move, ...], tuple[Ranges, ...]]:
    """Moves that spread the history evenly over ``group``, and each member's history after.

    ``held[r]`` is what ``group[r]`` holds now (new members hold nothing; ``held`` may be
    shorter than ``group``). Surplus members give their highest positions, in ring order, to
    deficit members in ring order; the result is deterministic.
    """
    if len(held) > len(group):
        raise ValueError("more holders than group members")
    held = list(held) + [()] * (len(group) - len(held))
    counts = [ranges_len(h) for h in held]
    targets = even_targets(counts, sum(counts))
    after = list(held)
    gives: list[tuple[int, Ranges]] = []
    for r, (n, t) in enumerate(zip(counts, targets)):
        if n > t:
            after[r], taken = take_tail(held[r], n - t)
            gives.append((r, taken))
    needs = [[r, t - n] for r, (n, t) in enumerate(zip(counts, targets)) if t > n]
    moves: list[Move] = []
    received: list[list[tuple[int, int]]] = [[] for _ in group]
    for src, taken in gives:
        # Hand the taken positions out in position order to the receivers in ring order.
        remaining = taken
        while remaining:
            dst_need = needs[0]
            k = min(dst_need[1], ranges_len(remaining))
            remaining, part = _take_head(remaining, k)
            moves.append(Move(src=group[src], dst=group[dst_need[0]], positions=part))
            received[dst_need[0]].extend(part)
            dst_need[1] -= k
            if dst_need[1] == 0:
                needs.pop(0)
    for r in range(len(group)):
        if received[r]:
            after[r] = normalize_ranges(list(after[r]) + received[r])
    return tuple(moves), tuple(after)


def _take_head(ranges: Ranges, n: int) -> tuple[Ranges, Ranges]:
    """Split off the first ``n`` positions: ``(rest, taken)``."""
    rest = list(ranges)
    taken: list[tuple[int, int]] = []
    while n > 0:
        lo, hi = rest.pop(0)
        k = min(n, hi - lo)
        taken.append((lo, lo + k))
        if lo + k < hi:
            rest.insert(0, (lo + k, hi))
        n -= k
    return normalize_ranges(rest), normalize_ranges(taken)


class LayerBalancer:
    """One member's side of a chunk's cache balancing, run one layer at a time.

    ``store`` is the member's ``PagedKVStore``; slots for incoming positions must have been
    reserved (``prepare``) before the chunk starts. Sent positions are released by the caller
    after the last layer (they are still read while later layers are sent).
    """

    def __init__(self, store, request_id: str, instance: int, moves: tuple[Move, ...],
                 tag: int, timeout_s: float, link: PeerLink | None = None) -> None:
        self.link = link or DefaultWorld()   # the chunk's world (actors/prefill/world.py)
        self.store = store
        self.request_id = request_id
        self.sends = [m for m in moves if m.src == instance]
        self.recvs = [m for m in moves if m.dst == instance]
        self.tag = tag
        self.timeout = timedelta(seconds=timeout_s)
        self.pending: dict[int, tuple[list, list, list]] = {}
        self.wait_s = 0.0
        self.sent_tokens = sum(ranges_len(m.positions) for m in self.sends)
        self.recv_tokens = sum(ranges_len(m.positions) for m in self.recvs)

    @property
    def active(self) -> bool:
        return bool(self.sends or self.recvs)

    def issue(self, layer: int) -> None:
        """Start layer ``layer``'s moves: pack ``[n, 2, Hkv, D]`` rows and post isend/irecv."""
        if not self.active or layer in self.pending or layer >= self.store.num_layers:
            return
        keep = []
        for m in self.sends:
            k, v = self.store.read(self.request_id, layer, m.positions)
            keep.append((torch.stack([k, v], dim=1).contiguous(), m.dst))
        bufs = [(m, self.store.empty_rows(ranges_len(m.positions), 2)) for m in self.recvs]
        works = self.link.exchange(keep, [(buf, m.src) for m, buf in bufs], self.tag)
        self.pending[layer] = (works, bufs, keep)

    def wait(self, layer: int) -> None:
        """Finish layer ``layer``'s moves and write what arrived into the store."""
        if not self.active:
            return
        t0 = time.perf_counter()   # in blocking mode the issue counts as balancing time too
        if layer not in self.pending:
            self.issue(layer)
        works, bufs, _keep = self.pending.pop(layer)
        for w in works:
            if not w.wait(self.timeout):
                raise TimeoutError(f"cache balancing of layer {layer} timed out")
        self.wait_s += time.perf_counter() - t0
        for m, buf in bufs:
            self.store.write(self.request_id, layer, m.positions, buf[:, 0], buf[:, 1])
