"""The decode pool's side of elastic decode: one world over the decode instances, rounds
in lockstep, and a request's ranges placed on its group (issue #25).

``ElasticWorld(instances)``:

- ``start``: rank r of every instance joins world r (``DecodeRank.join_elastic``; instance
  0's rank r serves its store), all at once;
- the round gate (``turn``): every instance's round loop waits at the gate before each round
  until every live instance of the world has arrived, so all of them run round k together
  (their ranks meet layer by layer inside it). An instance with nothing to do is woken
  (``DecodeInstance.nudge``) as soon as another wants a round, and the world sleeps when none
  does. A broken instance leaves the gate; its ranks' peers find it lost at their next
  exchange (the requests it held ranges of fail with ``HolderLost``, a resume);
- ``place``: a request's group, the ranges' reservations (``Reserve(kv_start)`` and ``Lead``
  on the master, ``Hold`` on each holder), then ``commit`` once every range's KV is on every
  rank of its holder (the master must not ask about a range still arriving);
- ``release``: ``Release`` on every member (after the master's stream ended).

What it does not do (docs/decode.md, "Not built"): the prefill pool streaming each range to
its holder (a test sender does it here), the dispatcher's placement, and a restarted instance
rejoining (a world's membership is fixed at ``start``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from tetris.actors.decode.elastic import Hold, Lead, Release, range_transfer_id
from tetris.actors.decode.messages import DecodeInstanceLost

__all__ = ["ElasticWorld"]

_GATE_POLL_S = 0.05   # a waiting instance re-checks for instances that broke meanwhile


class ElasticWorld:
    def __init__(self, instances: Sequence, *, timeout_s: float = 60.0) -> None:
        self.instances = list(instances)
        self.timeout_s = timeout_s
        self._keys = itertools.count(1)
        self._arrived: set[int] = set()
        self._released = asyncio.Event()
        self.wanted = False       # some instance waits at the gate: the others must come
        self.rounds = 0

    async def start(self) -> None:
        tp = self.instances[0].tp_size
        for r in range(tp):
            host, port = await self.instances[0].ranks[r].rendezvous.remote()
            await asyncio.wait_for(asyncio.gather(*[
                inst.ranks[r].join_elastic.remote(i, len(self.instances), host, port,
                                                  self.timeout_s)
                for i, inst in enumerate(self.instances)]), self.timeout_s)
        for inst in self.instances:
            inst.gate = self

    # -- the round gate -------------------------------------------------------------------------

    def _live(self) -> set[int]:
        return {i for i, inst in enumerate(self.instances) if inst.broken is None}

    async def turn(self, instance: int) -> None:
        """Wait until every live instance is ready for the next round."""
        released = self._released
        self._arrived.add(instance)
        if not self.wanted:
            self.wanted = True
            for i, inst in enumerate(self.instances):
                if i != instance:
                    inst.nudge()
        while not released.is_set():
            if self._live() <= self._arrived:
                self._arrived = set()
                self.wanted = False
                self.rounds += 1
                self._released = asyncio.Event()
                released.set()
                break
            try:
                await asyncio.wait_for(released.wait(), _GATE_POLL_S)
            except TimeoutError:
                pass

    # -- a request's group ----------------------------------------------------------------------

    async def place(self, request_id: str, prompt_token_ids, sampling,
                    ranges: Sequence[tuple[int, int, int]], generated=()) -> int:
        """Reserve ``ranges`` (instance, start, end), tiling the prompt (and ``generated``,
        the output a resumed request already made) in order; the last instance masters the
        request. Returns the request's key on the world's wire."""
        for i, _, _ in ranges:   # a lost member refuses the group (the caller places it anew)
            if self.instances[i].broken is not None:
                raise DecodeInstanceLost(f"decode instance {i} of {request_id}'s group is "
                                         f"broken: {self.instances[i].broken}")
        key = next(self._keys)
        master, kv_start, _ = ranges[-1]
        holders = tuple(i for i, _, _ in ranges[:-1])
        if master in holders or len(set(holders)) != len(holders):
            raise ValueError(f"{request_id}: one range per instance, got {list(ranges)}")
        for inst, s, e in ranges[:-1]:
            self.instances[inst].expect_range(range_transfer_id(request_id, s))
            self.instances[inst].submit(Hold(request_id, key, master, s, e))
        if holders:
            self.instances[master].submit(Lead(request_id, key, holders))
        await self.instances[master].reserve(request_id, prompt_token_ids, sampling, generated,
                                             kv_start=kv_start)
        return key

    async def commit(self, request_id: str, ranges: Sequence[tuple[int, int, int]],
                     first_token: int, logprob=None) -> None:
        """The master starts once every held range is on every rank of its holder."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        for inst, s, _ in ranges[:-1]:
            tid = range_transfer_id(request_id, s)
            while not self.instances[inst].range_ready(tid):
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"{tid} did not arrive on decode instance {inst}")
                await asyncio.sleep(self.instances[inst].poll_interval_s)
        self.instances[ranges[-1][0]].commit(request_id, first_token, logprob)

    def release(self, request_id: str, ranges: Sequence[tuple[int, int, int]]) -> None:
        for inst, s, _ in ranges:
            self.instances[inst].forget_range(range_transfer_id(request_id, s))
            self.instances[inst].submit(Release(request_id))
