"""Kernel launch choices that do not need a GPU: the Triton attention's launch override."""

from __future__ import annotations

import pytest
import torch

from tetris.kernels import dispatch
from tetris.kernels.attention import attention_with_lse_ref

ta = pytest.importorskip("tetris.kernels.triton_attention")


@pytest.mark.parametrize("text,want", [("", None), ("128,64,8,3", (128, 64, 8, 3)),
                                       (" 64,32,4,2 ", (64, 32, 4, 2))])
def test_the_launch_override_reads_the_environment(monkeypatch, text, want):
    monkeypatch.setenv("TETRIS_TRITON_ATTENTION", text)
    assert ta._launch_override() == want


@pytest.mark.parametrize("text", ["128,64,8", "100,64,8,3", "8,64,4,3", "a,b,c,d"])
def test_a_bad_launch_override_is_refused_with_its_text(monkeypatch, text):
    monkeypatch.setenv("TETRIS_TRITON_ATTENTION", text)
    with pytest.raises(ValueError, match="TETRIS_TRITON_ATTENTION"):
        ta._launch_override()


@pytest.mark.skipif(not ta.INTERPRETED, reason="runs the kernel under the interpreter")
def test_an_overridden_launch_computes_the_same_attention(monkeypatch):
    monkeypatch.setattr(ta, "LAUNCH_OVERRIDE", (32, 16, 4, 2))
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(40, 4, 16, generator=g), torch.randn(40, 2, 16, generator=g), \
        torch.randn(40, 2, 16, generator=g)
    out, lse = ta.attention_with_lse(q, k, v, causal=True)
    ref_out, ref_lse = attention_with_lse_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_off_cuda_the_cuda_flash_path_is_never_chosen():
    q = torch.randn(8, 4, 16, dtype=torch.bfloat16)
    assert dispatch.attention_backend_for(q, q[:, :2]) != "cuda_flash"
    assert "cuda_flash" not in dispatch.available_backends() or torch.cuda.is_available()
