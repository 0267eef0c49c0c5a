"""A monitor decision the served group driver could not apply (``ServedKunServe._tick``)
leaves the controller as it was: its groups and its drop / restore counts (as a forced one
does, ``_force``), so ``/admin/kunserve`` and the metrics count only what the instances ran.
In process, no Ray: the instances and the controller's choice are stand-ins."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tetris.actors.decode.kunserve_group import ServedKunServe
from tetris.control.drop_plan import Group
from tetris.control.kunserve import Decision


class _Controller:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.groups = [Group((0,), ((0, 4),)), Group((1,), ((0, 4),))]
        self.drops = self.restores = 0

    def decide(self, loads, fit_blocks=0):
        merged = [Group((0, 1), ((0, 2), (2, 4)))]
        self.groups = merged if self.kind == "drop" else self.groups
        setattr(self, f"{self.kind}s", getattr(self, f"{self.kind}s") + 1)
        return Decision(self.kind)


@pytest.mark.parametrize("kind", ["drop", "restore"])
def test_a_decision_not_applied_is_not_counted(kind):
    kun = ServedKunServe([SimpleNamespace(serving=True), SimpleNamespace(serving=True)])
    kun.controller = _Controller(kind)
    before = list(kun.controller.groups)
    kun.loads = lambda queued=None: {}

    async def refuse(groups, decision):
        raise ValueError("member 0's requests hold 9 blocks, its part of the group 8")

    kun._apply = refuse
    assert asyncio.run(kun.tick()) is None
    assert kun.controller.groups == before
    assert (kun.controller.drops, kun.controller.restores) == (0, 0)
    assert kun.refused == ["member 0's requests hold 9 blocks, its part of the group 8"]
