"""Finished runs whose KV a decode instance keeps: the decode side of prefix caching
(docs/prefix_cache.md).

A conversation's next turn resends the conversation so far. The decode instance that ran the
previous turn still holds that turn's KV (prompt and answer, but the answer's last token) if
it kept it (``engine/kept_kv.py``); routed there, the next turn shares the part of the prefix
the prefill pool had cached from it instead of receiving it over the network.

``DecodeKept`` is the control plane's record of those runs: per instance, each kept run's
block hashes (the same chained hashes as ``PrefixIndex``), at most ``per_instance`` runs, the
least recently used let go first. ``best`` finds the instance holding the longest cached
prefix of a prompt (where to route it), ``covering`` the kept run on an instance holding at
least ``tokens`` of it (what to copy from).

Pure: no Ray, no torch, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["DecodeKept", "shared_blocks"]


def shared_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading block hashes ``a`` and ``b`` have in common (chained: equal prefixes)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DecodeKept:
    def __init__(self, block_tokens: int, per_instance: int) -> None:
        if block_tokens <= 0 or per_instance <= 0:
            raise ValueError("block_tokens and per_instance must be positive")
        self.block_tokens = block_tokens
        self.per_instance = per_instance
        self._runs: dict[int, OrderedDict[str, tuple[int, ...]]] = {}
        self.reuses = 0
        self.reused_tokens = 0

    def add(self, instance: int, run_id: str, hashes: Sequence[int]) -> list[str]:
        """``run_id`` finished on ``instance``, which keeps KV covering ``hashes``; returns
        the runs of that instance let go to stay within ``per_instance`` (free them there)."""
        runs = self._runs.setdefault(instance, OrderedDict())
        runs[run_id] = tuple(hashes)
        runs.move_to_end(run_id)
        dropped = []
        while len(runs) > self.per_instance:
            dropped.append(runs.popitem(last=False)[0])
        return dropped

    def best(self, hashes: Sequence[int],
             up: frozenset[int] | None = None) -> tuple[int, str, int] | None:
        """(instance, run, blocks) of the kept run sharing the most leading blocks with
        ``hashes`` (at least one; instances in ``up`` only, when given), lowest instance and
        then most recent run on ties; None if none shares a block."""
        found, key = None, None
        for instance in sorted(self._runs):
            if up is not None and instance not in up:
                continue
            for order, (run, kept) in enumerate(self._runs[instance].items()):
                n = shared_blocks(kept, hashes)
                k = (n, -instance, order)
                if n and (key is None or k > key):
                    found, key = (instance, run, n), k
        return found

    def covering(self, instance: int, hashes: Sequence[int], tokens: int) -> str | None:
        """The kept run on ``instance`` holding the prompt's first ``tokens`` (whole blocks,
        as a prefix hit is), the most recent of those; it becomes the most recently used.
        ``reused`` counts the copy once it was made."""
        need = -(-tokens // self.block_tokens)
        runs = self._runs.get(instance, {})
        for run in reversed(list(runs)):
            if tokens > 0 and shared_blocks(runs[run], hashes) >= need:
                runs.move_to_end(run)
                return run
        return None

    def reused(self, tokens: int) -> None:
        self.reuses += 1
        self.reused_tokens += tokens

    def remove(self, instance: int, run_id: str) -> None:
        self._runs.get(instance, {}).pop(run_id, None)

    def lost(self, instance: int) -> list[str]:
        """The instance lost its KV (restarted): its runs are gone."""
        return list(self._runs.pop(instance, {}))

    def clear(self) -> list[tuple[int, str]]:
        """Every kept run, forgotten (free them where they lie)."""
        out = [(i, run) for i in sorted(self._runs) for run in self._runs[i]]
        self._runs.clear()
        return out

    def runs(self) -> dict[int, list[str]]:
        return {i: sorted(r) for i, r in sorted(self._runs.items()) if r}

    def stats(self) -> dict[str, int]:
        return {"decode_kept_runs": sum(len(r) for r in self._runs.values()),
                "decode_reuses": self.reuses, "decode_reused_tokens": self.reused_tokens}
