"""KunServe's admin routes and metrics over the EMULATION's driver: see the groups, force a
drop and a restore (the engines follow), and a forced drop that would lose the last copy of a
layer is refused with nothing changed."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tetris.bench.kunserve_emulated import KunServeEmulation
from tetris.control.kunserve_memory import InstanceMemory
from tetris.serve.kunserve_admin import add_kunserve_routes
from tetris.sim.kunserve import PoolProfile

MEM = InstanceMemory(num_layers=6, layer_param_bytes=4 * 4096, other_param_bytes=4096,
                     kv_bytes=32 * 6 * 512, layer_block_bytes=512, block_size=16)
PROF = PoolProfile(name="toy", instances=3, hbm_bytes_per_s=4e9, per_seq_s=1e-4,
                   prefill_s_per_token=1e-5, link_bytes_per_s=1e9, pcie_bytes_per_s=1e9,
                   activation_bytes_per_token=64)


@pytest.fixture
def pool():
    emu = KunServeEmulation([], MEM, PROF, "kunserve")
    app = FastAPI()
    add_kunserve_routes(app, emu)
    yield emu, TestClient(app)
    emu.close()


def _dropped(client):
    text = client.get("/metrics/kunserve").text
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("tetris:dropped_layers{")}


def test_forced_drop_and_restore_move_the_engines(pool):
    emu, client = pool
    view = client.get("/admin/kunserve").json()
    assert [g["members"] for g in view["groups"]] == [[0], [1], [2]]
    assert _dropped(client) == {"0": 0.0, "1": 0.0, "2": 0.0}
    view = client.post("/admin/kunserve/drop", json={"groups": [[0, 2]]}).json()
    pair = view["groups"][0]
    assert pair == {"members": [0, 2], "layer_ranges": [[0, 3], [3, 6]],
                    "kv_blocks": MEM.group_kv_blocks([3, 3])}
    assert [u.members for u in emu.units] == [(0, 2), (1,)]
    assert emu.units[0].engine.blocks.num_blocks == MEM.group_kv_blocks([3, 3]) > 2 * 32
    assert _dropped(client) == {"0": 3.0, "1": 0.0, "2": 3.0}
    assert "tetris:kunserve_kv_capacity_blocks{unit=\"0\"}" in client.get("/metrics/kunserve").text
    view = client.post("/admin/kunserve/restore", json={"leader": 0}).json()
    assert [g["members"] for g in view["groups"]] == [[0], [1], [2]]
    assert [u.engine.blocks.num_blocks for u in emu.units] == [32, 32, 32]
    assert view["drops"] == 1 and view["restores"] == 1


@pytest.mark.parametrize("body", [
    {"groups": [[0, 1]], "layer_ranges": [[[0, 3], [4, 6]]]},      # layer 3 would be lost
    {"groups": [[0, 1]], "layer_ranges": [[[0, 4], [3, 6]]]},      # layer 3 twice
    {"groups": [[0, 7]]},                                          # no instance 7
    {"groups": "0,1"},
])
def test_a_bad_forced_drop_is_refused_and_changes_nothing(pool, body):
    emu, client = pool
    before = client.get("/admin/kunserve").json()
    r = client.post("/admin/kunserve/drop", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert client.get("/admin/kunserve").json() == before
    assert [u.members for u in emu.units] == [(0,), (1,), (2,)]


def test_restoring_a_group_that_does_not_exist_is_refused(pool):
    _, client = pool
    assert client.post("/admin/kunserve/restore", json={"leader": 1}).status_code == 400
