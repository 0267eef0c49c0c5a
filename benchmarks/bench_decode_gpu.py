"""Decode tokens/s on a GPU: Tetris's engine (eager and CUDA-graph replay) against transformers'
``generate`` on the same random checkpoint, at batch 1/8/32 (issue #22).

The checkpoint has a real model's geometry (``--shape llama-1b``: Llama-3.2-1B; ``llama-8b``)
and random weights, saved in HF format and loaded by both systems onto the GPU in ``--dtype``.
Each system decodes the same prompts greedily, EOS ignored. Decode tokens/s is taken over the
steady steps: from the third token's step to the last one (the first step is the prefill; the
second may capture a CUDA graph), with the device synchronised at every stamp:

    decode tokens/s = B * (steps - 2) / (t_last - t_third)

All systems run in this one process, interleaved per batch size, so the ratios are side by
side. ``agreement`` is the share of tokens before each sequence's first difference from
transformers (bf16 sums in other orders: a near-tie flips a token sooner or later).

    python benchmarks/bench_decode_gpu.py [--shape llama-1b] [--batch-sizes 1 8 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_decode import agreement
from decode_models import SHAPES, build_checkpoint, load_hf, load_ours, model_config, stamps_hf, stamps_ours


def _synced() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _rate(stamps: list[float], batch: int) -> float:
    steady = stamps[2:]
    return batch * (len(steady) - 1) / (steady[-1] - steady[0])


def run(args) -> dict:
    shape = dict(SHAPES[args.shape])
    config = model_config(argparse.Namespace(**shape))
    config["max_position_embeddings"] = max(4096, args.prompt_len + args.new_tokens + 16)
    dev = args.device
    report = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev, "torch": torch.__version__,
              "shape": args.shape, "dtype": args.dtype, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp), config, seed=0, dtype=args.dtype, device=dev)
        hf = load_hf(path, args.dtype, device=dev)
        ours = load_ours(path, args.dtype, device=dev)
    gen = torch.Generator().manual_seed(1)
    systems = {
        "hf_generate": lambda p: stamps_hf(hf, p.to(dev), args.new_tokens, _synced),
        "tetris_eager": lambda p: stamps_ours(ours, p, args.new_tokens, _synced,
                                              {"cuda_graphs": False}),
        "tetris_graphs": lambda p: stamps_ours(ours, p, args.new_tokens, _synced,
                                               {"cuda_graphs": True}),
    }
    warm = torch.randint(10, config["vocab_size"], (2, 16), generator=gen)
    for fn in systems.values():   # kernels compiled and autotuned outside the timings
        fn(warm)
    for b in args.batch_sizes:
        prompts = torch.randint(10, config["vocab_size"], (b, args.prompt_len), generator=gen)
        best: dict[str, float] = {}
        tokens: dict[str, list] = {}
        for _ in range(args.repeats):
            for name, fn in systems.items():
                stamps, toks = fn(prompts)
                best[name] = max(best.get(name, 0.0), _rate(stamps, b))
                tokens[name] = toks
        row = {"batch": b, **{f"{k}_tok_s": v for k, v in best.items()}}
        row["graphs_vs_hf"] = best["tetris_graphs"] / best["hf_generate"]
        row["eager_vs_hf"] = best["tetris_eager"] / best["hf_generate"]
        for name in ("tetris_eager", "tetris_graphs"):
            row[f"{name}_agreement"], row[f"{name}_first_divergence"] = agreement(
                tokens[name], tokens["hf_generate"])
        report["rows"].append(row)
        print(f"batch {b}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items())
              + f"; graphs/hf {row['graphs_vs_hf']:.2f}x", file=sys.stderr, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        msg = "no CUDA device: GPU decode benchmark not run"
        print(json.dumps({"error": msg}) if args.json else msg)
        return 2
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"device: {report['device']}, {args.shape} {args.dtype}, prompt {args.prompt_len}, "
              f"{args.new_tokens} new tokens (decode tokens/s, steady steps)")
        for row in report["rows"]:
            print(f"  B={row['batch']:>3}: hf {row['hf_generate_tok_s']:8.1f}  tetris eager "
                  f"{row['tetris_eager_tok_s']:8.1f} ({row['eager_vs_hf']:.2f}x)  graphs "
                  f"{row['tetris_graphs_tok_s']:8.1f} ({row['graphs_vs_hf']:.2f}x)  agreement "
                  f"{row['tetris_graphs_agreement']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
