"""The control plane's KunServe decisions: drop on overload, restore on the valley, refuse."""

from tests.control.kunserve_profiles import even6
from tetris.control.kunserve import KunServeController
from tetris.control.kunserve_memory import InstanceLoad


def test_overload_drops_just_enough_then_restores_when_usage_halves():
    mem = even6()                       # 100 blocks per instance; a pair holds 210
    ctl = KunServeController(mem, [0, 1, 2, 3])
    calm = {i: InstanceLoad(100, 60) for i in range(4)}
    assert ctl.decide(calm) is None
    # Instance 0 is full with 15 blocks queued: one merge (+10 blocks) does not cover 15, two do.
    loads = {0: InstanceLoad(100, 100, 0, 15), 1: InstanceLoad(100, 100),
             2: InstanceLoad(100, 100), 3: InstanceLoad(100, 100)}
    d = ctl.decide(loads)
    assert d.kind == "drop" and d.drop.merges == 2
    assert [g.members for g in ctl.groups] == [(0, 1), (2, 3)]
    assert ctl.dropped_layers() == {0: 3, 1: 3, 2: 3, 3: 3}
    # Usage under half of the pair's undropped 200 blocks, nothing queued: restore one group.
    d = ctl.decide({0: InstanceLoad(210, 100), 2: InstanceLoad(210, 150)})
    assert d.kind == "restore" and d.restored_group.members == (0, 1)
    assert [g.members for g in ctl.groups] == [(0,), (1,), (2, 3)]
    assert {p.dst: (p.start, p.end, p.src) for p in d.restore.pulls} == {0: (3, 6, 1),
                                                                          1: (0, 3, 0)}
    assert ctl.dropped_layers() == {0: 0, 1: 0, 2: 3, 3: 3}
    # Queued work blocks a restore however low the usage.
    assert ctl.decide({0: InstanceLoad(100, 0), 1: InstanceLoad(100, 0),
                       2: InstanceLoad(210, 0, 0, 1)}) is None


def test_a_refused_drop_changes_nothing_and_says_why():
    ctl = KunServeController(even6(), [0, 1])
    before = list(ctl.groups)
    assert ctl.decide({0: InstanceLoad(100, 100, 0, 500), 1: InstanceLoad(100, 100)}) is None
    assert ctl.groups == before and ctl.drops == 0
    assert len(ctl.refusals) == 1 and "last copy" in ctl.refusals[0]


def test_an_idle_pool_drops_for_a_request_no_instance_holds_and_refuses_one_no_group_holds():
    ctl = KunServeController(even6(), [0, 1, 2, 3])
    idle = {i: InstanceLoad(100, 0) for i in range(4)}
    assert ctl.decide(idle, fit_blocks=100) is None             # instance 0 takes it
    # a 150-block request at instance 0 (its queue): the pool's 400 free blocks cover it
    d = ctl.decide(idle | {0: InstanceLoad(100, 0, 0, 150)}, fit_blocks=150)
    assert d.kind == "drop" and d.drop.merges == 1
    assert [g.members for g in ctl.groups] == [(0, 1), (2,), (3,)]
    assert ctl.fits_a_unit(210) and not ctl.fits_a_unit(211)
    # 330 blocks: the 410 free cover it, but no grouping of 6 layers takes more than 320
    before = list(ctl.groups)
    units = {0: InstanceLoad(210, 0, 0, 330), 2: InstanceLoad(100, 0), 3: InstanceLoad(100, 0)}
    assert ctl.decide(units, fit_blocks=330) is None
    assert ctl.groups == before and ctl.drops == 1
    assert "a request of 330 blocks fits no unit (the largest takes 320)" in ctl.refusals[-1]
