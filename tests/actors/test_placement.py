"""Placement of the pools on Ray nodes: the node-map rule, modes, error messages, and a real
two-node cluster (in a subprocess: this session already holds its own Ray connection)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tetris.actors.placement import (Placement, PlacementError, explain_unplaced, node_map,
                                     place_decode, place_prefill, resolve_mode)
from tetris.actors.process_env import CONTROL_ENV_VARS, runtime_env
from tetris.config import ConfigError, DecodeConfig, PrefillConfig, load_deployment

SCRIPT = Path(__file__).with_name("placement_cluster_script.py")


# -- the node map (pure) ----------------------------------------------------------------------
def test_one_ray_node_keeps_the_virtual_nodes(caplog):
    with caplog.at_level(logging.WARNING, logger="tetris.actors.placement"):
        assert node_map(["n1"] * 4, 2) == [0, 0, 1, 1]
        assert node_map(["n1"] * 6, 3) == [0, 0, 0, 1, 1, 1]
        assert node_map(["n1"] * 3, 1) == [0, 1, 2]
    assert not caplog.records


def test_several_ray_nodes_win_in_first_seen_order(caplog):
    with caplog.at_level(logging.WARNING, logger="tetris.actors.placement"):
        assert node_map(["y", "y", "x", "x"], 2) == [0, 0, 1, 1]
        assert node_map(["y", "x", "y", "x"], 2) == [0, 1, 0, 1]
    assert not caplog.records   # 2 per node, as configured


def test_a_node_size_mismatch_is_logged_and_the_real_nodes_win(caplog):
    with caplog.at_level(logging.WARNING, logger="tetris.actors.placement"):
        assert node_map(["a", "a", "a", "b"], 2) == [0, 0, 0, 1]
    [rec] = caplog.records
    assert rec.levelno == logging.WARNING
    assert "[3, 1]" in rec.getMessage() and "node_size=2" in rec.getMessage()


def test_node_map_rejects_a_bad_node_size():
    with pytest.raises(ValueError, match="node_size"):
        node_map(["a"], 0)


def test_auto_packs_on_several_nodes_only():
    assert resolve_mode("auto", 1) == "none"
    assert resolve_mode("auto", 2) == "pack"
    assert resolve_mode("spread", 1) == "spread"
    assert resolve_mode("none", 3) == "none"


def test_no_placement_reserves_nothing():
    assert Placement("none").options(3) == {"num_cpus": 0, "runtime_env": runtime_env()}


def test_actors_start_with_two_malloc_arenas(ray_session):
    """glibc reads MALLOC_ARENA_MAX at exec: it must be in the process's initial environment
    (/proc/PID/environ), which ``os.environ`` set inside the actor would not change."""
    import ray

    @ray.remote
    class Probe:
        def environ(self) -> dict:
            raw = Path(f"/proc/{os.getpid()}/environ").read_bytes().split(b"\0")
            return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)

    probe = Probe.options(**Placement("none").options(0)).remote()
    control = Probe.options(num_cpus=0, runtime_env=runtime_env(control=True)).remote()
    try:
        env = ray.get(probe.environ.remote(), timeout=120)
        assert env["MALLOC_ARENA_MAX"] == "2" and "MALLOC_MMAP_THRESHOLD_" not in env
        env = ray.get(control.environ.remote(), timeout=120)
        assert env["MALLOC_ARENA_MAX"] == "2" and env["MALLOC_MMAP_THRESHOLD_"] == "65536"
    finally:
        ray.kill(probe)
        ray.kill(control)


_MMAP_PROBE = """
from tetris.bench.heap_probe import malloc_stats
a = bytearray(200_000); del a          # mapped, unmapped: glibc's default raises its threshold
b = bytearray(200_000); del b
before = malloc_stats()["mmapped"]
c = bytearray(200_000)                 # where does the third one come from?
print(malloc_stats()["mmapped"] - before)
"""


def test_a_fixed_mmap_threshold_keeps_big_blocks_off_the_heap():
    """Why the control processes set MALLOC_MMAP_THRESHOLD_: with glibc's default, a 200 kB
    block allocated after one was freed comes from the heap (and a burst of them fragments
    it); with the threshold set, every such block is its own mapping, returned on free."""
    import subprocess
    import sys

    def mapped(env: dict) -> int:
        base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", _MMAP_PROBE], env=base | env,
                             capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert mapped({}) < 200_000
    assert mapped(CONTROL_ENV_VARS) >= 200_000


# -- config ------------------------------------------------------------------------------------
def test_config_fields_and_errors(tmp_path):
    pc = PrefillConfig()
    assert (pc.placement, pc.cpus_per_instance, pc.gpus_per_instance) == ("auto", 1.0, 0.0)
    assert DecodeConfig().placement == "auto"
    with pytest.raises(ValueError, match="not both 0"):
        PrefillConfig(cpus_per_instance=0.0)
    with pytest.raises(ValueError, match=">= 0"):
        DecodeConfig(cpus_per_rank=-1.0)
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nname = "m"\n[prefill]\nplacement = "scatter"\n')
    with pytest.raises(ConfigError, match="prefill.placement"):
        load_deployment(bad)
    good = tmp_path / "good.toml"
    good.write_text('[model]\nname = "m"\n[prefill]\nplacement = "spread"\ngpus_per_instance = 1\n'
                    '[decode]\nplacement = "pack"\ncpus_per_rank = 0.5\n')
    cfg = load_deployment(good)
    assert (cfg.prefill.placement, cfg.prefill.gpus_per_instance) == ("spread", 1.0)
    assert (cfg.decode.placement, cfg.decode.cpus_per_rank) == ("pack", 0.5)


# -- error messages (pure) --------------------------------------------------------------------
NODES = [{"node_id": "aaaaaaaaaaaa", "resources": {"CPU": 4.0}},
         {"node_id": "bbbbbbbbbbbb", "resources": {"CPU": 4.0, "GPU": 1.0}}]


def test_explain_names_the_missing_total():
    text = explain_unplaced([{"CPU": 1.0}] * 6, "PACK", NODES, {"CPU": 5.0})
    assert "need {CPU: 6}" in text and "missing {CPU: 1}" in text
    assert "no node" not in text   # one bundle fits anywhere


def test_explain_strict_pack_needs_one_big_node():
    text = explain_unplaced([{"CPU": 3.0}] * 2, "STRICT_PACK", NODES, {"CPU": 8.0})
    assert "missing" not in text   # enough in total ...
    assert "no node is big enough for all bundles together ({CPU: 6}" in text   # ... not on one


def test_explain_gpu_bundles():
    text = explain_unplaced([{"CPU": 1.0, "GPU": 2.0}] * 2, "PACK", NODES, {"CPU": 8.0, "GPU": 1.0})
    assert "missing {GPU: 3}" in text
    assert "no node is big enough for one bundle ({CPU: 1, GPU: 2}" in text


# -- placement groups on the session's (single-node) Ray --------------------------------------
@pytest.mark.ray
def test_placement_groups_on_one_node(ray_session):
    import ray

    here = ray.get_runtime_context().get_node_id()
    pre = place_prefill(PrefillConfig(placement="spread", cpus_per_instance=0.5), 4)
    dec = place_decode(DecodeConfig(tp_size=2, cpus_per_rank=0.5), 0, mode="pack")
    try:
        assert pre.mode == "spread" and sorted(pre.bundle_of) == [0, 1, 2, 3]
        assert pre.node_ids == (here,) * 4
        assert dec.bundle_of == (0, 1) and dec.node_ids == (here, here)
        opts = dec.options(1)
        assert opts["num_cpus"] == 0
        assert opts["scheduling_strategy"].placement_group_bundle_index == 1
        # auto on one node places nothing
        assert place_prefill(PrefillConfig(), 4).pg is None
    finally:
        pre.remove()
        dec.remove()


@pytest.mark.ray
def test_unplaceable_group_fails_fast_with_the_missing_resources(ray_session):
    import ray

    cpus = ray.cluster_resources()["CPU"]
    with pytest.raises(PlacementError, match=r"prefill pool \(2 instances\).*missing \{CPU"):
        place_prefill(PrefillConfig(placement="pack", num_instances=2, node_size=1,
                                    cpus_per_instance=cpus), 2, timeout_s=1.0)
    # the pending group was removed: its CPUs are all available again
    assert ray.available_resources().get("CPU", 0.0) > cpus - 1.0


# -- a real two-node cluster ------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_two_node_cluster_places_and_runs_across_nodes():
    # A private RAY_TMPDIR: the cluster's head writes its address file there, not where other
    # Ray sessions on this machine would find it and connect.
    tmp = tempfile.mkdtemp(prefix="tplc", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_TMPDIR": tmp, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                              text=True, timeout=280)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["nodes"] == 2
    # SPREAD put 2 workers on each node; instances are grouped by node, so the node map is the
    # real one and has the configured shape.
    nodes = out["prefill_nodes"]
    assert sorted(nodes) == ["a", "a", "b", "b"] and nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert nodes == out["prefill_bundle_nodes"]
    assert out["node_map"] == [0, 0, 1, 1]
    # the last chunk's ring spans both nodes and gives the single-process logits
    assert out["chunk_nodes"][-1] == ["a", "b"]
    assert out["first_token"] == out["ref_token"]
    assert out["logits_max_diff"] < 1e-4
    # the TP-2 decode instance is on one node, rank r in bundle r, and decodes
    assert len(set(out["decode_nodes"])) == 1
    assert out["decode_nodes"] == out["decode_bundle_nodes"]
    assert out["decode_tokens"] == 3
    assert "no node is big enough for all bundles together ({CPU: 6}" in out["strict_pack_error"]
