"""The dispatcher's choice among decode units of different sizes (``route``)."""

import numpy as np

from tetris.control.kunserve_dispatch import UnitRoom, route


def test_the_least_used_share_wins_among_units_with_room():
    rooms = [UnitRoom(0, 60_000, 27_960),     # a 72B group of 2: 68% used
             UnitRoom(2, 20_000, 10_591),     # 65%
             UnitRoom(3, 25_000, 5_591)]      # 82%
    assert route(100, rooms) == 1
    assert route(10_600, rooms) == 0         # only the group has room for 10,600
    assert route(30_000, rooms) is None      # nobody has: the request waits


def test_a_roomy_group_is_not_the_emptiest_unit_by_free_blocks_alone():
    # The group has the most free blocks (27,960 > 10,591) but the larger share in use: the
    # most-free-blocks rule would send the request there.
    rooms = [UnitRoom(0, 60_000, 27_960), UnitRoom(2, 20_000, 10_591)]
    assert max(range(2), key=lambda i: rooms[i].free) == 0
    assert route(1, rooms) == 1


def test_ties_go_to_the_lowest_leader():
    assert route(1, [UnitRoom(4, 100, 100), UnitRoom(1, 50, 50), UnitRoom(2, 50, 9)]) == 1


def test_among_equal_instances_it_is_the_unit_with_the_most_free_blocks():
    """Before any drop the routing is the earlier rule's: most free blocks, lowest id on ties,
    wait when that unit has no room (so the baselines' runs are unchanged)."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        n, cap = int(rng.integers(1, 9)), 1000
        used = rng.integers(0, cap + 1, n)
        need = int(rng.integers(1, 400))
        rooms = [UnitRoom(i, int(u), cap - int(u)) for i, u in enumerate(used)]
        best = max(range(n), key=lambda i: (rooms[i].free, -i))
        assert route(need, rooms) == (best if rooms[best].free >= need else None)
