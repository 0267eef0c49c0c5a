"""``tetris bench policies``: orders of policies, simulated and (tiny, EMULATION) live."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from tetris.bench.policies import compare_orders, order, policy_deployment, run_policies
from tetris.cli.bench_policies import add_args, run
from tetris.config import load_deployment

NAN = float("nan")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


def test_order_is_ascending_with_ties_by_name_and_nan_last():
    assert order({"b": 2.0, "a": 2.0, "c": 1.0, "d": NAN}) == ["c", "a", "b", "d"]


def test_a_common_offset_keeps_the_order():
    sim = {"tetris": 0.73, "fixed-sp-8": 1.08, "loongserve-disagg": 1.46}
    live = {k: v + 0.9 for k, v in sim.items()}     # the hand-off adds the same to all
    c = compare_orders(sim, live)
    assert c["agree"] and c["discordant"] == [] and c["sim_ties"] == []
    assert c["sim"] == c["live"] == ["tetris", "fixed-sp-8", "loongserve-disagg"]


def test_a_swapped_pair_disagrees_and_is_named():
    sim = {"tetris": 0.73, "fixed-sp-8": 1.08, "loongserve-disagg": 1.46}
    live = {"tetris": 1.2, "fixed-sp-8": 1.1, "loongserve-disagg": 2.0}
    c = compare_orders(sim, live)
    assert not c["agree"] and c["discordant"] == [["fixed-sp-8", "tetris"]]


def test_a_simulated_tie_is_not_judged_but_a_real_gap_is():
    sim = {"a": 0.451, "b": 0.460, "c": 0.52}        # a, b 2% apart: a tie at 5%
    live = {"a": 0.50, "b": 0.47, "c": 0.60}
    c = compare_orders(sim, live, tie=0.05)
    assert c["agree"] and c["sim_ties"] == [["a", "b"]]
    assert not compare_orders(sim, live, tie=0.01)["agree"]


def test_a_policy_without_a_live_value_cannot_agree():
    c = compare_orders({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": NAN})
    assert not c["agree"] and c["discordant"] == [["a", "b"]] and c["live"] == ["a", "b"]
    with pytest.raises(ValueError, match="different policies"):
        compare_orders({"a": 1.0}, {"b": 1.0})


def test_policy_deployment_replaces_only_the_policy_and_rejects_what_cannot_run(tmp_path):
    base = load_deployment("paper-llama3-8b-emulated.toml")
    cfg = policy_deployment(base, "fixed-sp-8")
    assert cfg.scheduler.policy == "fixed-sp-8" and cfg.scheduler.sp_candidates == (1, 2, 4, 8, 16)
    assert cfg.prefill == base.prefill and cfg.transfer == base.transfer
    with pytest.raises(ValueError, match="not a policy of a disaggregated"):
        policy_deployment(base, "loongserve")
    with pytest.raises(ValueError, match="profile 'a100-llama3-8b-tp1' has no SP size 32"):
        policy_deployment(base, "fixed-sp-32")
    with pytest.raises(ValueError, match="fixed-sp-8 needs at least 8 prefill instances"):
        policy_deployment(load_deployment(_tiny_config(tmp_path)), "fixed-sp-8")
    with pytest.raises(ValueError, match="unknown policy"):
        policy_deployment(base, "round-robin")


def test_simulated_orders_past_the_baseline_capacity_put_tetris_first(tmp_path):
    # 5 req/s is 1.15x fixed-sp-8's simulated capacity on Short (docs/figures/capacity_8b.md):
    # the paper's claim, as our simulator reproduces it, on the benchmark's default trace.
    out = run(_args("--sim-only", "--rate", "5", "--plot", str(tmp_path / "p.png")))
    (o,) = out["orders"]
    assert o["p50"]["sim"] == ["tetris", "fixed-sp-8", "loongserve-disagg"]
    assert o["agree"] is None and out["orders_agree"] is None and not out["emulation"]
    assert [r["policy"] for r in out["results"]] == ["tetris", "fixed-sp-8", "loongserve-disagg"]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="must not repeat"):
        run_policies(None, policies=["tetris", "tetris"], rates=[1.0], live=False)


def _tiny_config(tmp_path) -> str:
    # The paper's emulated 8B cluster cut to 4 prefill instances on 2 nodes and one decode
    # instance: app start-up dominates this test, and it grows with the number of actors.
    src = open(load_deployment("paper-llama3-8b-emulated.toml").source_path).read()
    path = tmp_path / "tiny4.toml"
    path.write_text(src.replace("num_instances = 16", "num_instances = 4")
                    .replace("node_size = 8", "node_size = 2")
                    .replace("sp_candidates = [1, 2, 4, 8, 16]", "sp_candidates = [1, 2, 4]")
                    .replace("num_instances = 2\ntp_size = 8", "num_instances = 1\ntp_size = 2")
                    .replace("num_backends = 16", "num_backends = 4")
                    .replace("pool_size = 16", "pool_size = 4"))
    return str(path)


def _trace(tmp_path) -> str:
    path = tmp_path / "trace.csv"
    rows = [(0.0, 9000), (0.2, 4000), (0.3, 12000), (0.5, 6000), (0.6, 8000), (0.8, 5000)]
    path.write_text("request_id,arrival_time,prompt_tokens,output_tokens\n" + "".join(
        f"r{i},{t},{p},3\n" for i, (t, p) in enumerate(rows)))
    return str(path)


@pytest.mark.timeout(300)
def test_tiny_live_comparison_completes_with_plans_of_each_policys_shape(serve_http, tmp_path):
    out = run(_args("--config", _tiny_config(tmp_path), "--workload", _trace(tmp_path),
                    "--policies", "tetris,fixed-sp-4", "--rate", "4", "--requests", "6",
                    "--time-scale", "3", "--max-output", "3"))
    assert out["emulation"] is True and "EMULATION" in out["label"]
    assert sorted(out["app_startup_s"]) == ["fixed-sp-4", "tetris"]
    rows = {r["policy"]: r for r in out["results"]}
    for r in rows.values():
        assert r["failed"] == 0 and r["errors"] == [] and r["live_plans"]["requests"] == 6
        # The same emulated compute plus the control plane and hand-off: never below the sim.
        assert r["live_ttft_s"]["p50"] >= r["sim_ttft_s"]["p50"] * 0.98
    # fixed-sp-4 on a pool of 4: one chunk on the one group of 4, whatever the queues.
    fixed = rows["fixed-sp-4"]["live_plans"]
    assert fixed["sp_sizes"] == [[4]] * 6 and fixed["sp_size_chunks"] == {"4": 6}
    for sizes in rows["tetris"]["live_plans"]["sp_sizes"]:
        # CDSP chunks only ever grow their group (G_next ⊇ G_cur, SPEC §3).
        assert sizes and sizes == sorted(sizes) and set(sizes) <= {1, 2, 4}
    (o,) = out["orders"]
    for m in ("p50", "p99"):
        expect = compare_orders({p: rows[p]["sim_ttft_s"][m] for p in rows},
                                {p: rows[p]["live_ttft_s"][m] for p in rows}, out["tie_tolerance"])
        assert o[m] == expect
    assert out["orders_agree"] == (o["p50"]["agree"] and o["p99"]["agree"])
    json.loads(json.dumps(out))
    assert not any(math.isnan(rows[p]["live_ttft_s"]["p99"]) for p in rows)
