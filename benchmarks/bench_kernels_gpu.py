"""GPU kernel benchmark: attention step TFLOP/s and paged-decode memory bandwidth (issue #8).

Side by side in one run, at each context length (8k, 32k, 128k tokens by default):

- attention step, causal over T tokens (Hq=32, Hkv=8, D=128 by default: Llama-3-8B): the
  Triton kernel (position-masked path; ``--triton-configs`` adds other launch configurations),
  torch's flash SDPA on pre-expanded K/V, ``cuda_flash`` (the same kernel as a ring step runs
  it: GQA expansion and LSE included), and flash-attn when installed;
  TFLOP/s counts the causal half only, 2 * T^2 * Hq * D (two matmuls of 2*T*T*D/2 each), and
  is also given as a share of the GPU's dense bf16 peak;
- paged decode, a batch of sequences of T tokens each: the Triton split-K kernel (and
  flash-attn's paged kernel when installed); bandwidth counts the K and V bytes read,
  B * T * Hkv * D * 2 * 2, as a share of the GPU's HBM peak.

Needs CUDA (exits with status 2 and says so otherwise); the Triton kernels are compiled, not
interpreted, whatever TRITON_INTERPRET says in the environment.

    python benchmarks/bench_kernels_gpu.py [--tokens 8192 32768 131072] [--decode-batch 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # before any triton import: benchmark compiled kernels

import torch  # noqa: E402

# Dense (no sparsity) bf16 tensor-core peak in TFLOP/s and HBM peak in TB/s, from vendor sheets.
PEAKS = {
    "H200": (989.4, 4.8),
    "H100 80GB HBM3": (989.4, 3.35),  # SXM
    "H100 PCIe": (756.0, 2.0),
    "H100 NVL": (835.0, 3.9),
    "A100-SXM4-80GB": (312.0, 2.039),
    "A100-SXM4-40GB": (312.0, 1.555),
    "A100 80GB PCIe": (312.0, 1.935),
    "L40S": (362.0, 0.864),
}


def device_peaks(name: str, tflops: float | None, tbps: float | None) -> tuple[float | None, float | None]:
    match = next((v for k, v in PEAKS.items() if k in name), (None, None))
    return tflops or match[0], tbps or match[1]


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def attention_row(tokens: int, hq: int, hkv: int, d: int, triton_configs=()) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tetris.kernels import cuda_flash
    from tetris.kernels import flash_attn_backend as fab
    from tetris.kernels import triton_attention as ta
    from tetris.kernels.triton_attention import attention_with_lse

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    # SDPA's flash kernel has no GQA: give it K/V expanded to Hq heads, [1, H, T, D].
    qs = q.transpose(0, 1).unsqueeze(0)
    ks = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1).unsqueeze(0)
    vs = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1).unsqueeze(0)
    flops = 2.0 * tokens * tokens * hq * d
    row = {"tokens": tokens}

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    candidates = {"triton": lambda: attention_with_lse(q, k, v, causal=True), "torch_flash_sdpa": sdpa,
                  # what a ring step runs at serve time: GQA expansion and the LSE included
                  "cuda_flash": lambda: cuda_flash.attention_with_lse(q, k, v, causal=True)}
    if fab.AVAILABLE:
        candidates["flash_attn"] = lambda: fab.flash_step(q, k, v, True, d**-0.5)
    for name, fn in candidates.items():
        ms = bench_ms(fn)
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
    for config in triton_configs:   # the Triton kernel under other launch configurations
        ta.LAUNCH_OVERRIDE = config
        try:
            ms = bench_ms(lambda: attention_with_lse(q, k, v, causal=True))
        finally:
            ta.LAUNCH_OVERRIDE = None
        name = "triton_" + "x".join(map(str, config))
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
    if tokens <= 8192:  # a sanity check that the timed kernels agree
        diff = (attention_with_lse(q, k, v, causal=True)[0] - sdpa()[0].transpose(0, 1)).abs().max()
        row["triton_vs_sdpa_max_abs_diff"] = float(diff)
    del q, k, v, qs, ks, vs
    torch.cuda.empty_cache()
    return row


def _paged_cache(batch: int, tokens: int, page: int, hkv: int, d: int, g):
    maxb = (tokens + page - 1) // page
    k_cache = torch.randn(batch * maxb, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * maxb, device="cuda", generator=g).view(batch, maxb).to(torch.int32)
    return k_cache, v_cache, tables


def decode_row(tokens: int, batch: int, page: int, hq: int, hkv: int, d: int) -> dict:
    from tetris.kernels import flash_attn_backend as fab
    from tetris.kernels.triton_paged_decode import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    kv_bytes = batch * tokens * hkv * d * 2 * 2
    row = {"tokens": tokens, "batch": batch, "kv_bytes": kv_bytes}
    k_cache, v_cache, tables = _paged_cache(batch, tokens, page, hkv, d, g)
    ms = bench_ms(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens))
    row.update(triton_ms=ms, triton_tbps=kv_bytes / (ms * 1e-3) / 1e12)
    del k_cache, v_cache, tables
    if fab.AVAILABLE:  # flash-attn's paged kernel needs 256-token pages
        k_cache, v_cache, tables = _paged_cache(batch, tokens, fab.PAGE_MULTIPLE, hkv, d, g)
        ms = bench_ms(lambda: fab.paged_decode_attention(q, k_cache, v_cache, tables, lens))
        row.update(flash_attn_ms=ms, flash_attn_tbps=kv_bytes / (ms * 1e-3) / 1e12)
        del k_cache, v_cache, tables
    torch.cuda.empty_cache()
    return row


def add_shares(rows: list[dict], key_suffix: str, peak: float | None) -> None:
    for row in rows:
        for key in [k for k in row if k.endswith(key_suffix)]:
            row[key.replace(key_suffix, "_peak_share")] = row[key] / peak if peak else None


def print_table(report: dict) -> None:
    print(f"device: {report['device']}  peaks: {report['peak_bf16_tflops']} TFLOP/s bf16, "
          f"{report['peak_hbm_tbps']} TB/s HBM")
    print("attention step, causal (TFLOP/s, share of bf16 peak):")
    for row in report["attention"]:
        cells = [f"{k[:-7]} {row[k]:.1f} ({row.get(k[:-7] + '_peak_share') or 0:.0%})"
                 for k in row if k.endswith("_tflops")]
        print(f"  T={row['tokens']:>7}: " + ", ".join(cells))
    print("paged decode (TB/s, share of HBM peak):")
    for row in report["decode"]:
        cells = [f"{k[:-5]} {row[k]:.2f} ({row.get(k[:-5] + '_peak_share') or 0:.0%})"
                 for k in row if k.endswith("_tbps")]
        print(f"  B={row['batch']} x T={row['tokens']:>7}: " + ", ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--page", type=int, default=16, help="cache block size of the Triton decode")
    parser.add_argument("--peak-tflops", type=float, help="override the bf16 peak of the device")
    parser.add_argument("--peak-tbps", type=float, help="override the HBM peak of the device")
    parser.add_argument("--triton-configs", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES",
                        help="also time the Triton attention under these launch configurations")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    args = parser.parse_args(argv)
    configs = [tuple(int(x) for x in c.split(",")) for c in args.triton_configs]

    if not torch.cuda.is_available():
        msg = "no CUDA device: GPU kernel benchmark not run"
        print(json.dumps({"error": msg}) if args.json else msg)
        return 2
    from tqdm import tqdm

    name = torch.cuda.get_device_name()
    peak_tflops, peak_tbps = device_peaks(name, args.peak_tflops, args.peak_tbps)
    report = {"device": name, "torch": torch.__version__, "peak_bf16_tflops": peak_tflops,
              "peak_hbm_tbps": peak_tbps, "attention": [], "decode": []}
    shape = (args.heads, args.kv_heads, args.head_dim)
    for tokens in tqdm(args.tokens, desc="context lengths", disable=args.json, file=sys.stderr):
        report["attention"].append(attention_row(tokens, *shape, triton_configs=configs))
        report["decode"].append(decode_row(tokens, args.decode_batch, args.page, *shape))
    add_shares(report["attention"], "_tflops", peak_tflops)
    add_shares(report["decode"], "_tbps", peak_tbps)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
