"""Decode throughput: LLMEngine against transformers ``generate`` on the same checkpoint.

Builds a seeded random Llama checkpoint on disk (HF format), then for each batch size runs
the same prompts through both, greedy, EOS ignored, and reports decode tokens/s. Decode time
runs from the moment the first tokens are sampled (prefill done) to the moment the last ones
are: for transformers, a pass-through logits processor stamps every forward pass; for the
engine, the steps that return the first and the last tokens. With N new tokens per sequence:

    decode tokens/s = B * (N - 1) / (t_last - t_first)

Both run in this one process, one after the other for each batch size, so the ratio is taken
side by side under the same machine load. ``--repeats`` keeps the fastest of several runs.
On a machine shared with other jobs, wall time mostly measures the others' load: ``--clock cpu``
times with the process's CPU time instead (``time.process_time``, all threads), the work each
system needed; with ``--threads 1`` that excludes OpenMP's spin-waiting too.
``--baseline`` adds a third system, the engine with its CPU speed-ups off (``ENGINE_BASELINE``:
unpacked weights), so before/after ratios come from the same run too.

``--dtype`` saves the checkpoint in that dtype and runs both systems in it (transformers with
its default attention implementation). In fp32 the greedy tokens are expected to be identical
(``identical`` counts whole sequences); in bf16 the two sum in different orders and a near-tie
of the top two logits flips a token sooner or later, after which the continuations differ. So
every row also reports ``agreement``: the share of tokens before each sequence's first
difference, and ``first_divergence``: the earliest position (0-based) where any sequence of the
batch differs (None: none does).

    python benchmarks/bench_decode.py                 # table, the "small" shape
    python benchmarks/bench_decode.py --shape tiny    # per-step overhead dominates there
    python benchmarks/bench_decode.py --json          # one JSON object
    python benchmarks/bench_decode.py --baseline      # also the engine without its speed-ups
    python benchmarks/bench_decode.py --dtype bfloat16 # a bf16 checkpoint, both sides in bf16
    python benchmarks/bench_decode.py --dtype bfloat16 --batch-sizes 32 --thread-scaling 1 2

``--thread-scaling`` times single decode steps (wall clock) of both systems at each thread
count, rounds interleaved, and reports medians; then the same for the bare decode GEMMs
(the engine's packed oneDNN call and ``F.linear``, one call per sample).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from decode_models import (CLOCKS, DTYPES, ENGINE_BASELINE, SHAPES, build_checkpoint,
                           load_hf, load_ours, model_config, stamps_hf, stamps_ours, time_hf,
                           time_ours)


def measure(systems, prompts, new_tokens: int, repeats: int):
    """Fastest decode time of each system over ``repeats`` rounds, and its tokens.

    The systems alternate within every round, so a burst of load from other processes on a
    shared machine hits both rather than one.
    """
    best = {name: float("inf") for name in systems}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, (fn, model) in systems.items():
            elapsed, tokens[name] = fn(model, prompts, new_tokens)
            best[name] = min(best[name], elapsed)
    return best, tokens


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, int | None]:
    """(share of tokens before each sequence's first difference, earliest difference or None).

    Tokens after a difference are not compared: from there the two condition on different
    contexts, so matching ones would be chance.
    """
    prefix, first = 0, None
    total = 0
    for a, b in zip(ours, ref, strict=True):
        if len(a) != len(b):
            raise ValueError(f"sequences of {len(a)} and {len(b)} tokens")
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix += same
        total += len(a)
        if same < len(a):
            first = same if first is None else min(first, same)
    return (prefix / total if total else 1.0), first


def compare(tokens: dict[str, list[list[int]]], name: str, ref: str = "hf") -> dict:
    same = sum(a == h for a, h in zip(tokens[name], tokens[ref], strict=True))
    share, first = agreement(tokens[name], tokens[ref])
    return dict(identical_sequences=f"{same}/{len(tokens[ref])}", agreement=share,
                first_divergence=first)


def run(args) -> dict:
    from tqdm import tqdm

    config = model_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(args.checkpoint or tmp) / "bench-llama", config, args.seed,
                                args.dtype)
        clock = CLOCKS[args.clock]
        systems = {"hf": (partial(time_hf, clock=clock), load_hf(path, args.dtype)),
                   "tetris": (partial(time_ours, clock=clock), load_ours(path, args.dtype))}
        if args.baseline:  # its own model: packing is a property of the model object
            systems["baseline"] = (partial(time_ours, clock=clock,
                                           engine_options=ENGINE_BASELINE),
                                   load_ours(path, args.dtype))
        gen = torch.Generator().manual_seed(args.seed)
        rows = []
        for b in tqdm(args.batch_sizes, desc="batch sizes", file=sys.stderr):
            prompts = torch.randint(3, config["vocab_size"], (b, args.prompt_len), generator=gen)
            for fn, model in systems.values():
                fn(model, prompts[:1], 3)  # warm-up (lazy inits, allocator)
            times, tokens = measure(systems, prompts, args.new_tokens, args.repeats)
            decoded = b * (args.new_tokens - 1)
            row = dict(
                batch=b,
                hf_tokens_per_s=decoded / times["hf"],
                tetris_tokens_per_s=decoded / times["tetris"],
                speedup=times["hf"] / times["tetris"],
                **compare(tokens, "tetris"),
            )
            if args.baseline:
                row.update(baseline_tokens_per_s=decoded / times["baseline"],
                           baseline_speedup=times["hf"] / times["baseline"],
                           **{f"baseline_{k}": v for k, v in compare(tokens, "baseline").items()})
            rows.append(row)
    return dict(
        benchmark="decode", shape=args.shape, model=config, prompt_len=args.prompt_len,
        new_tokens=args.new_tokens, repeats=args.repeats, dtype=args.dtype,
        torch_threads=torch.get_num_threads(), clock=args.clock,
        baseline_options=ENGINE_BASELINE if args.baseline else None, rows=rows,
    )


def gemm_shapes(config: dict) -> list[tuple[str, int, int]]:
    """(name, in, out) of the engine's decode GEMMs: fused q/k/v, o_proj, fused gate/up and
    down_proj (once per layer each), then the LM head."""
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, f = h // heads, config["intermediate_size"]
    return [("qkv", h, (heads + 2 * kv) * d), ("o_proj", heads * d, h), ("gate_up", h, 2 * f),
            ("down", f, h), ("lm_head", h, config["vocab_size"])]


def _rotated(keys: list, r: int) -> list:
    """Round ``r``'s order: rotated and reversed in turn, so no variant always runs first
    or right after the same other one (load bursts on a shared machine spread over all)."""
    order = keys[r % len(keys):] + keys[:r % len(keys)]
    return order[::-1] if r % 2 else order


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _gemm_medians(config: dict, dtype: str, rows: int, threads: list[int],
                  repeats: int) -> list[dict]:
    """Median single-call time of each decode GEMM, the engine's packed oneDNN call against
    ``F.linear`` (what transformers calls), per thread count, all variants interleaved."""
    import torch.nn.functional as F

    from tetris.model.packed import PackedWeight

    gen = torch.Generator().manual_seed(0)
    calls = {}
    for name, k, n in gemm_shapes(config):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(DTYPES[dtype])
        x = torch.randn(rows, k, generator=gen).to(DTYPES[dtype])
        calls[(name, "packed")] = partial(PackedWeight(w, rows), x)
        calls[(name, "linear")] = partial(F.linear, x, w)
    samples = {(key, t): [] for key in calls for t in threads}
    for r in range(repeats):
        for key, t in _rotated(list(samples), r):
            torch.set_num_threads(t)
            calls[key]()  # the first call after a thread-count change pays for the team
            start = time.perf_counter()
            calls[key]()
            samples[(key, t)].append(time.perf_counter() - start)
    return [dict(shape=name, threads=t, packed_ms=_median_ms(samples[((name, "packed"), t)]),
                 linear_ms=_median_ms(samples[((name, "linear"), t)]))
            for name, _, _ in gemm_shapes(config) for t in threads]


def thread_scaling(args) -> dict:
    """Median decode-step time of both systems at each thread count (wall clock), rounds
    interleaved; then the bare GEMMs the same way. Medians of single steps, not best totals:
    one burst of load then moves a few samples, not a whole run."""
    from tqdm import tqdm

    config = model_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(args.checkpoint or tmp) / "bench-llama", config, args.seed,
                                args.dtype)
        models = {"hf": (stamps_hf, load_hf(path, args.dtype)),
                  "tetris": (stamps_ours, load_ours(path, args.dtype))}
    batch = max(args.batch_sizes)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, config["vocab_size"], (batch, args.prompt_len), generator=gen)
    steps = {(name, t): [] for name in models for t in args.thread_scaling}
    for r in tqdm(range(args.repeats + 1), desc="rounds", file=sys.stderr):
        for name, t in _rotated(list(steps), r):
            torch.set_num_threads(t)
            fn, model = models[name]
            stamps, _ = fn(model, prompts, args.new_tokens)
            if r:  # round 0 warms both up at every thread count
                steps[(name, t)] += [b - a for a, b in zip(stamps, stamps[1:])]
    return dict(
        benchmark="decode_thread_scaling", shape=args.shape, model=config, batch=batch,
        prompt_len=args.prompt_len, new_tokens=args.new_tokens, rounds=args.repeats,
        dtype=args.dtype, load_average=_loadavg(),
        steps=[dict(system=name, threads=t, median_step_ms=_median_ms(v))
               for (name, t), v in steps.items()],
        gemms=_gemm_medians(config, args.dtype, batch, args.thread_scaling, 40 * args.repeats),
    )


def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def print_scaling(result: dict) -> None:
    m = result["model"]
    print(f"Llama {m['num_hidden_layers']}L h{m['hidden_size']} V{m['vocab_size']} "
          f"{result['dtype']}, batch {result['batch']}, wall clock, medians over "
          f"{result['rounds']} interleaved rounds; loadavg {result['load_average']}")
    step = {(r["system"], r["threads"]): r["median_step_ms"] for r in result["steps"]}
    threads = sorted({t for _, t in step})
    print(f"{'threads':>7} {'hf ms/step':>11} {'tetris ms/step':>15} {'hf/tetris':>10}")
    for t in threads:
        print(f"{t:>7} {step[('hf', t)]:>11.2f} {step[('tetris', t)]:>15.2f} "
              f"{step[('hf', t)] / step[('tetris', t)]:>9.2f}x")
    print(f"{'GEMM':>8} {'threads':>7} {'packed ms':>10} {'F.linear ms':>12}")
    for g in result["gemms"]:
        print(f"{g['shape']:>8} {g['threads']:>7} {g['packed_ms']:>10.3f} {g['linear_ms']:>12.3f}")


def print_table(result: dict) -> None:
    m = result["model"]
    print(f"Llama {m['num_hidden_layers']}L h{m['hidden_size']} V{m['vocab_size']} "
          f"{result['dtype']}, "
          f"prompt {result['prompt_len']}, {result['new_tokens']} new tokens, "
          f"{result['torch_threads']} torch threads, best of {result['repeats']}, "
          f"{result['clock']} clock")
    base = result["baseline_options"] is not None
    agree = f"{'identical':>10} {'agreement':>10} {'1st diff':>8}"
    head = f"{'batch':>5} {'hf tok/s':>10} {'tetris tok/s':>13} {'speedup':>8} {agree}"
    if base:
        head += f" {'baseline tok/s':>15} {'speedup':>8} {agree}"
    print(head)
    for r in result["rows"]:
        line = (f"{r['batch']:>5} {r['hf_tokens_per_s']:>10.1f} {r['tetris_tokens_per_s']:>13.1f} "
                f"{r['speedup']:>7.2f}x {_agreement_cells(r)}")
        if base:
            line += (f" {r['baseline_tokens_per_s']:>15.1f} {r['baseline_speedup']:>7.2f}x "
                     f"{_agreement_cells(r, 'baseline_')}")
        print(line)


def _agreement_cells(row: dict, prefix: str = "") -> str:
    first = row[f"{prefix}first_divergence"]
    return (f"{row[f'{prefix}identical_sequences']:>10} {row[f'{prefix}agreement']:>9.1%} "
            f"{'-' if first is None else first:>8}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    for name in ("hidden", "intermediate", "layers", "heads", "kv-heads", "vocab"):
        p.add_argument(f"--{name}", type=int, help="overrides the shape's value")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="checkpoint dtype; both systems run in it")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--checkpoint", help="folder to keep the checkpoint in (default: a temp dir)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: perf_counter; cpu: this process's CPU time (shared machines)")
    p.add_argument("--baseline", action="store_true",
                   help="also time the engine with its CPU speed-ups off (ENGINE_BASELINE)")
    p.add_argument("--thread-scaling", type=int, nargs="+", metavar="THREADS",
                   help="instead: median step times at these thread counts (largest batch)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads is not None:
        if args.threads <= 0:
            p.error("--threads must be positive")
        torch.set_num_threads(args.threads)
    if min(args.batch_sizes) <= 0 or args.new_tokens < 2 or args.prompt_len <= 0:
        p.error("batch sizes and --prompt-len must be positive, --new-tokens at least 2")
    if args.thread_scaling and min(args.thread_scaling) <= 0:
        p.error("--thread-scaling thread counts must be positive")
    result = thread_scaling(args) if args.thread_scaling else run(args)
    if args.json:
        print(json.dumps(result))
    else:
        (print_scaling if args.thread_scaling else print_table)(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
