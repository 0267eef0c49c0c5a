"""Decode-side prefix reuse with the kept prefix shared by reference count (engine/kept_kv.py)
beside the same reuse with the prefix copied into the new request's blocks (what the decode
side did before), in one run on one CPU engine, for real (no EMULATION, no SIMULATION).

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_shared_prefix.py [--sessions 8]
        [--doc-tokens 1024] [--turn-tokens 64] [--turns 4] [--output-tokens 16]
        [--repeats 3] [--json]

Workload: ``sessions`` conversations, each a document of ``doc-tokens`` and ``turns`` turns; a
turn resends the conversation so far and ``turn-tokens`` new tokens. Every finished turn is
kept on the engine (``decode_runs`` = turns); turn t > 1 reads the whole kept KV of turn t - 1
(it ends inside a block) and receives only the rest, written as a prefill streams it (the
prefill's KV is computed once and written alike in both modes). Reported per mode: the blocks
the engine holds after each round of turns, the time of each turn's reservation with its
prefix read (shared: refcounts and the boundary block's copy; copied: every prefix position of
every layer), medians over repeats; the modes' greedy tokens must be equal (checked).
The model is ``configs/tiny-cpu.toml``'s (4 layers, 2 KV heads of 32), 16-token blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tetris.kernels.attention import attention_with_lse_ref
from tetris.kernels.paged_decode import write_kv

from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.engine.kept_kv import KeptKV
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

BS = 16
MODES = ("shared", "copied")


@torch.inference_mode()
def _prefill_kv(model, prompt):
    """Every layer's K and V of ``prompt`` as one prefill computes them, and the first token."""
    kv = []

    def capture(layer, q, k, v):
        kv.append((k.clone(), v.clone()))
        return attention_with_lse_ref(q, k, v, causal=True)[0]

    hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), capture)
    return kv, int(model.logits(hidden[-1:])[0].argmax(-1))


def _slots(table, start, end):
    pos = torch.arange(start, end)
    return torch.tensor(table, dtype=torch.int64)[pos // BS] * BS + pos % BS


def _copy_prefix(engine, kept, run, table, upto):
    """The decode side before sharing: positions [0, upto) of the run's KV copied into the
    request's own blocks, every layer."""
    src, dst = _slots(kept.runs[run][0], 0, upto), _slots(table, 0, upto)
    for layer in range(len(engine.cache.k)):
        for t in (engine.cache.k[layer], engine.cache.v[layer]):
            flat = t.view(-1, *t.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))


def _reserve(engine, kept, mode, rid, prompt, params, prev):
    """Reserve ``rid`` reading ``prev``'s kept KV: the positions read, and the seconds taken."""
    upto = kept.tokens(prev)
    t0 = time.perf_counter()
    if mode == "shared":
        table = engine.reserve_blocks(rid, prompt, params, shared=kept.shared_blocks(prev, upto))
        kept.copy_boundary(prev, table, upto)
    else:
        table = engine.reserve_blocks(rid, prompt, params)
        _copy_prefix(engine, kept, prev, table, upto)
    return table, upto, time.perf_counter() - t0


def run_mode(mode, model, tok, args, prefills, num_blocks):
    engine = LLMEngine(model, tok, num_blocks=num_blocks, block_size=BS,
                       max_num_seqs=args.sessions)
    kept = KeptKV(engine)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    history = {s: _ids(args.doc_tokens, 1000 + s) for s in range(args.sessions)}
    used, reserve_s, outputs = [], [], {}
    for turn in range(args.turns):
        for s in range(args.sessions):
            rid = f"s{s}t{turn}"
            prompt = history[s] + _ids(args.turn_tokens, 100 * s + turn)
            if tuple(prompt) not in prefills:   # the same prompts in every mode and repeat
                prefills[tuple(prompt)] = _prefill_kv(model, prompt)
            kv, first = prefills[tuple(prompt)]
            if turn == 0:
                table, upto = engine.reserve_blocks(rid, prompt, params), 0
            else:
                table, upto, took = _reserve(engine, kept, mode, rid, prompt, params,
                                             f"s{s}t{turn - 1}")
                reserve_s.append(took)
            slots = _slots(table, upto, len(prompt))
            for layer, (k, v) in enumerate(kv):   # the rest, as the prefill streams it
                write_kv(engine.cache.k[layer], engine.cache.v[layer], k[upto:], v[upto:], slots)
            engine.commit_prefilled(rid, first)
            kept.want(rid)
            history[s] = prompt
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.token_ids)
        for s in range(args.sessions):
            history[s] = history[s] + outputs[f"s{s}t{turn}"]
        used.append(num_blocks - engine.num_free_blocks)
    return {"used_blocks": used, "reserve_ms": 1e3 * statistics.median(reserve_s),
            "outputs": outputs}


def _ids(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model, tok = load_model(load_deployment("configs/tiny-cpu.toml").model)
    longest = args.doc_tokens + args.turns * (args.turn_tokens + args.output_tokens)
    # room for every turn of every session copied: both modes run without eviction
    num_blocks = args.sessions * args.turns * (-(-longest // BS) + 1)
    prefills: dict = {}
    runs = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:   # alternating: drift over the run falls on both
            runs[mode].append(run_mode(mode, model, tok, args, prefills, num_blocks))
    same = all(r["outputs"] == runs["shared"][0]["outputs"] for m in MODES for r in runs[m])
    result = {m: {"used_blocks": runs[m][0]["used_blocks"],
                  "reserve_ms_median": statistics.median(r["reserve_ms"] for r in runs[m])}
              for m in MODES}
    result["blocks_ratio_last_round"] = (result["shared"]["used_blocks"][-1]
                                         / result["copied"]["used_blocks"][-1])
    result["reserve_ratio"] = (result["shared"]["reserve_ms_median"]
                               / result["copied"]["reserve_ms_median"])
    result["same_tokens"] = same
    result["args"] = vars(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.sessions} sessions x {args.turns} turns, document {args.doc_tokens} tokens, "
          f"{args.turn_tokens} new + {args.output_tokens} output tokens a turn; "
          f"{args.repeats} repeats, one CPU engine (real, not EMULATION)")
    for m in MODES:
        print(f"  {m:7s} blocks held after each round {result[m]['used_blocks']}, "
              f"reserve + prefix read {result[m]['reserve_ms_median']:.3f} ms (median)")
    print(f"  shared/copied: blocks after the last round {result['blocks_ratio_last_round']:.3f}, "
          f"reserve time {result['reserve_ratio']:.3f}; same greedy tokens: {same}")
    if not same:
        raise SystemExit("the modes' greedy tokens differ")


if __name__ == "__main__":
    main()
