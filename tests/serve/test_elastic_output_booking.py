"""The dispatcher's elastic routing keeps a split master's output room booked from the KV's
arrival until the run ends (serve/elastic_dispatch.py): once the instances report their used
blocks, a whole request does not get the room a master's next tokens need (tests/engine/
test_elastic_output_room.py: given away, the master's round fails; kept, its tokens are the
engine's). Without the fix the master's room after arrival counted its output as free."""

from __future__ import annotations

import asyncio

import msgspec

from tetris.config import load_deployment
from tetris.scheduler.router import DecodeRouter
from tetris.serve.elastic_dispatch import make_routing

CAPACITY, PROMPT, OUTPUT = 512, 700, 100


class Released:
    def __init__(self) -> None:
        self.released: list[str] = []

    async def elastic_release(self, run_id, ranges) -> None:
        self.released.append(run_id)


def _routing():
    dep = load_deployment(None)
    dep = msgspec.structs.replace(dep, decode=msgspec.structs.replace(
        dep.decode, num_instances=2, elastic=True))
    router = DecodeRouter([CAPACITY, CAPACITY])
    return router, make_routing(dep, router, [CAPACITY, CAPACITY])


def test_a_split_masters_output_room_stays_booked_until_it_ends():
    router, routing = _routing()
    group = routing.route("a", PROMPT, OUTPUT)
    assert group.sharded
    master = group.master
    ranges = routing.ranges("a")
    on = {i: sum(e - s for j, s, e in ranges if j == i) for i in (0, 1)}   # prompt KV held
    assert sum(on.values()) == PROMPT and on[master] + OUTPUT <= CAPACITY
    # the KV arrives; each instance then reports the blocks its prompt range uses
    routing.arrived("a")
    routing.arrived("a")   # reported twice (arrival, then the first output): booked once
    for i in (0, 1):
        router.update(i, CAPACITY - on[i], batch_size=int(i == master))
    room = CAPACITY - on[master] - OUTPUT
    assert routing.placer.room(master) == room   # was room + OUTPUT before the fix
    # a whole request needing more than that room is not placed on the master's instance
    # when the holder has it; one that fits the room may be
    holder = 1 - master
    assert routing.placer.room(holder) > room
    whole = routing.route("b", room + 1 - 4, 4)
    assert not whole.sharded and whole.master == holder
    routing.arrived("b")
    # the run ends: its output booking goes, and every range is released
    decode = Released()
    asyncio.run(routing.free(decode, "a", completed=True))
    asyncio.run(routing.free(decode, "b", completed=True))
    assert decode.released == ["a"] and router.virtual == [0, 0]
    assert routing.placer.room(master) == room + OUTPUT
