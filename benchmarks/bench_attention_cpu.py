"""CPU attention paths side by side: fp32 reference, blocked torch path, aten CPU flash.

Masks: causal, none, and "positions" (one zigzag ring step, absolute-position mask).

    OMP_NUM_THREADS=1 python benchmarks/bench_attention_cpu.py [--tokens 1024 2048] [--json]

Each configuration times every path in one process, interleaved round by round (median of
``--repeats``), and reports times and the speed-up of each path over the reference. Outputs
are checked against the reference before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tetris.kernels.attention import (
    attention_with_lse,
    attention_with_lse_cpu_flash,
    attention_with_lse_ref,
)

PATHS = {"reference": attention_with_lse_ref, "torch": attention_with_lse,
         "cpu_flash": attention_with_lse_cpu_flash}


def _time_round(fn, args, kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def _mask_kwargs(mask: str, tokens: int) -> dict:
    if mask == "none":
        return {}
    if mask == "causal":
        return {"causal": True}
    # A zigzag ring step with 2 members over a chunk of 2*tokens: member 0's queries hold
    # pieces 0 and 3 of 4, the keys are member 1's pieces 1 and 2.
    piece = tokens // 2
    chunk = torch.arange(4 * piece)
    qp = torch.cat([chunk[:piece], chunk[3 * piece:]])
    kp = chunk[piece:3 * piece]
    return {"q_positions": qp, "k_positions": kp}


def bench(tokens: int, dtype: torch.dtype, mask: str, repeats: int, hq=8, hkv=2, d=64):
    g = torch.Generator().manual_seed(0)
    tokens = tokens // 2 * 2
    q = torch.randn(tokens, hq, d, generator=g).to(dtype)
    k = torch.randn(tokens, hkv, d, generator=g).to(dtype)
    v = torch.randn(tokens, hkv, d, generator=g).to(dtype)
    kwargs = _mask_kwargs(mask, tokens)
    ref_out, _ = attention_with_lse_ref(q, k, v, **kwargs)
    for name, fn in PATHS.items():
        out, _ = fn(q, k, v, **kwargs)
        err = (out.float() - ref_out.float()).abs().max().item()
        if err > (1e-4 if dtype == torch.float32 else 5e-2):
            raise RuntimeError(f"{name} disagrees with the reference by {err}")
    times = {name: [] for name in PATHS}
    for _ in range(repeats):  # interleaved so that machine load hits every path alike
        for name, fn in PATHS.items():
            times[name].append(_time_round(fn, (q, k, v), kwargs))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "tokens": tokens, "dtype": str(dtype).removeprefix("torch."), "mask": mask,
        "heads": f"{hq}q/{hkv}kv", "head_dim": d,
        "median_ms": {n: round(t * 1e3, 2) for n, t in med.items()},
        "speedup_vs_reference": {n: round(med["reference"] / t, 2) for n, t in med.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    rows = [bench(t, dt, m, args.repeats) for t in args.tokens
            for dt in (torch.float32, torch.bfloat16) for m in ("causal", "none", "positions")]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": rows}))
        return
    print(f"torch threads: {torch.get_num_threads()}")
    for r in rows:
        ms, sp = r["median_ms"], r["speedup_vs_reference"]
        print(f"T={r['tokens']:5d} {r['dtype']:8s} {r['mask']:9s} "
              + "  ".join(f"{n} {ms[n]:8.2f} ms (x{sp[n]:.2f})" for n in PATHS))


if __name__ == "__main__":
    main()
