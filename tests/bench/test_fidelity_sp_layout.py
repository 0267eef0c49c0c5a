"""``tetris bench fidelity`` with a deployment's ``[sp_layout]``: the simulated side plans with
the layout chooser as the live dispatcher does, and a time scale slows the chooser's links too."""

from __future__ import annotations

import msgspec
import pytest

from tetris.bench.fidelity import scale_deployment, simulate, trace_for
from tetris.config import SpLayoutConfig, load_deployment

A2A_FULL = SpLayoutConfig(layouts=("ring", "a2a"), ring_overlap=False)


def _lone(tmp_path, tokens: int):
    path = tmp_path / "trace.csv"
    path.write_text(f"request_id,arrival_time,prompt_tokens,output_tokens\na,0.0,{tokens},4\n")
    return trace_for(str(path), 0.01, 1, 0, 4)


def _with(layout: SpLayoutConfig):
    cfg = load_deployment("paper-llama3-8b-emulated.toml")
    return msgspec.structs.replace(cfg, sp_layout=layout)


def test_the_simulated_side_runs_the_deployments_layout_choice(tmp_path):
    trace = _lone(tmp_path, 120_000)
    ring = simulate(_with(SpLayoutConfig()), trace)
    a2a = simulate(_with(A2A_FULL), trace)
    # each run ends when its plan said (the a2a plan's estimate holds its layout delta) ...
    for out in (ring, a2a):
        assert out["ttft_s"][0] == pytest.approx(out["plans"][0]["ttft_estimate_s"], rel=1e-6)
    # ... and the chunks moved off the ring (charged in full) end earlier than ring only's
    assert a2a["ttft_s"][0] < ring["ttft_s"][0] * 0.99


def test_a_time_scale_slows_the_layout_choosers_links_alike(tmp_path):
    cfg = _with(A2A_FULL)
    slow = scale_deployment(cfg, 4.0, tmp_path)
    lay = slow.sp_layout
    assert (lay.intra_node_gbps, lay.inter_node_gbps) == (60.0, 6.25)
    assert lay.message_latency_s == pytest.approx(40e-6)
    assert lay.layouts == ("ring", "a2a") and lay.ring_overlap is False
    trace = _lone(tmp_path, 120_000)
    # the same plan, every term (Eq. 1 and the layout delta) 4x as long
    fast_out, slow_out = simulate(cfg, trace), simulate(slow, trace)
    assert slow_out["plans"][0]["sp_sizes"] == fast_out["plans"][0]["sp_sizes"]
    assert slow_out["ttft_s"][0] == pytest.approx(4 * fast_out["ttft_s"][0], rel=1e-6)
