"""torch's CUDA flash kernel as a ring-step backend (kernels/cuda_flash.py), and the Triton
attention under the launch configurations the kernel benchmark compares. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tetris.kernels import cuda_flash, dispatch
from tetris.kernels.attention import attention_with_lse_ref

ta = pytest.importorskip("tetris.kernels.triton_attention")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _qkv(tq, tk, hq=32, hkv=8, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(tq, hq, d, generator=g, device="cuda", dtype=torch.bfloat16),
            torch.randn(tk, hkv, d, generator=g, device="cuda", dtype=torch.bfloat16),
            torch.randn(tk, hkv, d, generator=g, device="cuda", dtype=torch.bfloat16))


def _close_to_ref(got, q, k, v, **kw):
    want = attention_with_lse_ref(q.float(), k.float(), v.float(), **kw)
    torch.testing.assert_close(got[1], want[1], atol=2e-2, rtol=1e-3)
    torch.testing.assert_close(got[0].float(), want[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tq,tk,causal", [(1000, 1000, True), (777, 1500, False), (5, 3000, False)])
def test_cuda_flash_matches_the_fp32_reference(tq, tk, causal):
    q, k, v = _qkv(tq, tk)
    assert dispatch.attention_backend_for(q, k, causal=causal) == "cuda_flash"
    _close_to_ref(cuda_flash.attention_with_lse(q, k, v, causal=causal), q, k, v, causal=causal)


def test_cuda_flash_declines_what_it_cannot_compute():
    q, k, v = _qkv(64, 64)
    pos = torch.arange(64, device="cuda")
    assert dispatch.attention_backend_for(q, k, q_positions=pos, k_positions=pos) == "triton"
    assert dispatch.attention_backend_for(q.float(), k.float()) == "triton"
    assert not cuda_flash.cuda_flash_supports(q[:10], k, True, None, None)   # causal, Tq != Tk
    out, lse = cuda_flash.attention_with_lse(q[:0], k, v)
    assert out.shape == (0, 32, 128) and lse.shape == (32, 0)
    out, lse = cuda_flash.attention_with_lse(q, k[:0], v[:0])
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("config", [None, (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_triton_attention_under_each_launch_config(monkeypatch, config, masked):
    monkeypatch.setattr(ta, "LAUNCH_OVERRIDE", config)
    q, k, v = _qkv(1200, 1200, seed=3)
    kw = {"q_positions": torch.arange(1200, device="cuda") + 300,
          "k_positions": torch.arange(1200, device="cuda") * 2} if masked else {"causal": True}
    _close_to_ref(ta.attention_with_lse(q, k, v, **kw), q, k, v, **kw)
