"""The prefill plan contract: coverage, growing groups, stable ring positions."""

from __future__ import annotations

import msgspec
import pytest

from tetris.plan import Chunk, PlanError, PrefillPlan


def _plan(*chunks: tuple[int, int, tuple[int, ...]], total: int | None = None) -> PrefillPlan:
    cs = tuple(Chunk(start=s, end=e, instances=g) for s, e, g in chunks)
    return PrefillPlan(request_id="r", prompt_tokens=total if total is not None else cs[-1].end, chunks=cs)


def test_valid_growing_plan():
    p = _plan((0, 100, (2, 3)), (100, 250, (2, 3, 0, 1)), (250, 400, (2, 3, 0, 1, 4, 5, 6, 7)))
    assert p.validate(pool_size=8) is p
    assert [c.sp_size for c in p.chunks] == [2, 4, 8]
    assert [c.history_tokens for c in p.chunks] == [0, 100, 250]
    assert p.instances == (2, 3, 0, 1, 4, 5, 6, 7)


@pytest.mark.parametrize(
    "chunks, total, fragment",
    [
        (((0, 100, (0,)), (120, 200, (0, 1))), None, "should start at 100"),
        (((0, 100, (0,)),), 150, "cover 100 of 150"),
        (((0, 100, (0, 1)), (100, 200, (1, 0, 2))), None, "groups only grow"),
        (((0, 100, (0, 1)), (100, 200, (0,))), None, "groups only grow"),
        (((0, 100, (0, 0)),), None, "distinct"),
        (((0, 0, (0,)), (0, 10, (0,))), None, "at least one token"),
        (((0, 100, (0, 9)),), None, "outside 0..7"),
    ],
)
def test_broken_plans_are_rejected(chunks, total, fragment):
    with pytest.raises(PlanError, match=fragment):
        _plan(*chunks, total=total).validate(pool_size=8)


def test_plan_round_trips_through_msgspec():
    p = _plan((0, 64, (1,)), (64, 128, (1, 5)))
    data = msgspec.msgpack.encode(p)
    assert msgspec.msgpack.decode(data, type=PrefillPlan) == p
