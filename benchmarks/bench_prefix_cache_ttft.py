"""Prefix caching on the served CPU cluster, for real: the TTFT of a second question about a
document, and of a conversation's second turn, beside the first question's, with the cache on
and off, in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefix_cache_ttft.py [--doc-tokens 4096]
        [--question-tokens 64] [--output-tokens 16] [--repeats 3] [--json]

The whole app of ``tiny-cpu.toml`` (tiny seeded model; 4 prefill workers on 2 virtual nodes,
gloo; a TP-2 decode instance; KV streamed over the transfer backend), deployed twice on one Ray
instance: ``[prefix_cache]`` on (16-token blocks, decode-side reuse of 4 runs an instance),
on for the prefill pool only (``decode_runs = 0``: the cached prefix is streamed to decode),
and off. Each repeat uses a fresh document and sends, one at a time: question 1 (cold), question 2
(the same document, another question), and the second turn (question 1, its answer and a
follow-up), after two warm-up requests. TTFT is the caller's, through the ingress handle (dispatcher, prefill pool, KV
transfer, decode instance, first output); medians over the repeats. Every request's greedy
tokens with the cache must equal those without (the script checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import msgspec
import torch

from tetris.bench.fidelity_live import LiveCluster, start_ray
from tetris.config import load_deployment
from tetris.sampling_params import SamplingParams

KINDS = ("q1", "q2", "turn2")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SETTINGS = {"on": (True, 4), "prefill_only": (True, 0), "off": (False, 0)}


def _deployment(setting: str):
    dep = load_deployment("tiny-cpu.toml")
    cache, decode_runs = SETTINGS[setting]
    pc = msgspec.structs.replace(dep.prefix_cache, enabled=cache, block_tokens=16,
                                 capacity_blocks=8192, decode_runs=decode_runs)
    return msgspec.structs.replace(dep, prefix_cache=pc, prefill=msgspec.structs.replace(
        dep.prefill, kv_blocks_per_instance=4096))


async def _ttft(live: LiveCluster, prompt: list[int], max_tokens: int, rid: str):
    """(TTFT s, output token ids) of one streamed request."""
    from tetris.serve.types import GenerationRequest

    req = GenerationRequest(prompt_token_ids=tuple(prompt), request_id=rid,
                            sampling=SamplingParams(max_tokens=max_tokens, temperature=0,
                                                    ignore_eos=True))
    sent, first, tokens = time.perf_counter(), None, []
    async for d in live.ingress.options(stream=True).generate_stream.remote(req):
        if first is None and d.new_token_ids:
            first = time.perf_counter()
        tokens += list(d.new_token_ids)
    return first - sent, tokens


def _run(cache: str, args) -> list[dict]:
    rows = []
    with LiveCluster(_deployment(cache), app_name=f"prefix-{cache}") as live:
        async def go():
            # a fresh app's first requests pay one-time costs (connections, allocations):
            # not part of any measured request
            for w in range(2):
                await _ttft(live, _ids(args.doc_tokens // 2, 900 + w), 2, f"warm-{w}-{cache}")
            for rep in range(args.repeats):
                doc = _ids(args.doc_tokens, 100 + rep)
                q1 = doc + _ids(args.question_tokens, 200 + rep)
                row = {}
                row["q1"] = await _ttft(live, q1, args.output_tokens, f"q1-{rep}-{cache}")
                q2 = doc + _ids(args.question_tokens, 300 + rep)
                row["q2"] = await _ttft(live, q2, args.output_tokens, f"q2-{rep}-{cache}")
                turn2 = q1 + row["q1"][1] + _ids(args.question_tokens, 400 + rep)
                row["turn2"] = await _ttft(live, turn2, args.output_tokens, f"t2-{rep}-{cache}")
                rows.append(row)
        asyncio.run(go())
        stats = live.dispatcher.prefix_cache.remote(clear=True).result(timeout_s=120)
    return rows, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    start_ray()
    got = {s: _run(s, args) for s in SETTINGS}
    stats = got["on"][1]
    runs = {s: rows for s, (rows, _) in got.items()}
    for s in ("on", "prefill_only"):
        for a, b in zip(runs[s], runs["off"]):
            for k in KINDS:
                assert a[k][1] == b[k][1], f"{k}: the cache ({s}) changed the greedy tokens"
    med = {f"{k}_{s}": statistics.median(r[k][0] for r in rows)
           for s, rows in runs.items() for k in KINDS}
    out = {"doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
           "output_tokens": args.output_tokens, "repeats": args.repeats,
           "ttft_s": {s: [{k: r[k][0] for k in KINDS} for r in rows] for s, rows in runs.items()},
           "median_s": med, "index": {k: v for k, v in stats.items() if k != "source_runs"},
           "q2_over_q1_on": med["q2_on"] / med["q1_on"],
           "q2_on_over_off": med["q2_on"] / med["q2_off"],
           "turn2_on_over_off": med["turn2_on"] / med["turn2_off"],
           "turn2_on_over_prefill_only": med["turn2_on"] / med["turn2_prefill_only"]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"served CPU cluster (tiny-cpu.toml), document {args.doc_tokens} + question "
          f"{args.question_tokens} tokens, {args.output_tokens} output tokens, "
          f"{args.repeats} repeats; TTFT through the ingress")
    for s in SETTINGS:
        for r in out["ttft_s"][s]:
            print(f"  cache {s:12}: " + "  ".join(f"{k} {r[k]:.3f} s" for k in KINDS))
    print("median: " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()))
    print(f"q2 / q1 with the cache {out['q2_over_q1_on']:.3f}; cache on / off: q2 "
          f"{out['q2_on_over_off']:.3f}, second turn {out['turn2_on_over_off']:.3f}; second "
          f"turn on / prefill only {out['turn2_on_over_prefill_only']:.3f}")
    print(f"index: {out['index']}")


if __name__ == "__main__":
    main()
