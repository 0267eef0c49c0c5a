"""The decode path's choice of CUDA graphs or eager steps, as a pure function (engine/graph_mode.py)."""

from __future__ import annotations

from tetris.engine.graph_mode import decode_graph_mode


def test_graphs_on_cuda_for_one_rank_and_for_tp_on_nccl():
    assert decode_graph_mode("cuda:0", 1, None).cuda_graphs is True
    mode = decode_graph_mode("cuda:0", 2, "nccl")
    assert mode.cuda_graphs is True and "NCCL all-reduce captured" in mode.reason


def test_tp_on_gloo_runs_eager_even_on_cuda_and_says_why():
    mode = decode_graph_mode("cuda:1", 4, "gloo")
    assert mode.cuda_graphs is False
    assert "gloo" in mode.reason and "cannot capture" in mode.reason


def test_off_cuda_eager_unless_the_padded_path_is_asked_for():
    for tp, backend in ((1, None), (2, "gloo")):
        assert decode_graph_mode("cpu", tp, backend).cuda_graphs is False
        asked = decode_graph_mode("cpu", tp, backend, requested=True)
        assert asked.cuda_graphs is True and "eagerly" in asked.reason


def test_a_setting_that_switches_graphs_off_wins_everywhere():
    for device, tp, backend in (("cuda", 1, None), ("cuda", 2, "nccl"), ("cpu", 1, None)):
        assert decode_graph_mode(device, tp, backend, requested=False).cuda_graphs is False
