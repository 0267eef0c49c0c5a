"""Prefix caching's three placements of a hit's first chunk on the CPU prefill pool, for real
(tiny seeded model, Ray workers, gloo; no EMULATION, no SIMULATION), side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefix_move.py [--doc-tokens 2048]
        [--question-tokens 64] [--busy-tokens 3072] [--repeats 3] [--json]

A document's first question runs on instances {0, 1} (its KV stays there: the holders H). The
second question is then run three ways (issue #23 item 2):

- ``extend``: chunk 0 on H + {2, 3}, the holders' copy of the prefix spread by cache balancing;
- ``move``: chunk 0 on G = {2, 3}, the prefix's KV exported by H (their transfer thread) and
  imported on G first (actors/prefill/prefix_move.py);
- ``recompute``: the whole prompt on {0, 1, 2, 3}, no cache;

each once with H idle and once with H busy: another request's chunk of ``busy-tokens`` tokens
committed on H just before the question (so ``extend`` and ``recompute`` wait for it, and
``move`` exports beside it). Reported per setting: the question's time from its run call to
its first token (``PrefillPool.run`` wall time), medians over repeats, and ratios against
``extend`` measured in the same run; every answer's first token must equal the others' (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import ray
import torch
from tetris.actors.prefill.pool import PrefillPool

from tetris.config import load_deployment
from tetris.plan import Chunk, PrefillPlan

PLACEMENTS = ("extend", "move", "recompute")
HOLDERS, OTHERS = (0, 1), (2, 3)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _plan(placement: str, rid: str, doc: int, total: int, source: str) -> PrefillPlan:
    if placement == "recompute":
        return PrefillPlan(rid, total, (Chunk(0, total, HOLDERS + OTHERS),))
    group = OTHERS if placement == "move" else HOLDERS + OTHERS
    return PrefillPlan(rid, total, (Chunk(doc, total, group),), cached_tokens=doc,
                       cached_instances=HOLDERS, cached_source=source,
                       cached_moved=placement == "move")


def _question(pool, placement, rid, ids, doc, source, busy_tokens) -> tuple[float, int]:
    """The question's run time (and first token), with H busy on a chunk when ``busy_tokens``."""
    plan = _plan(placement, rid, doc, len(ids), source)
    busy = None
    if busy_tokens:
        filler = PrefillPlan(f"{rid}-busy", busy_tokens, (Chunk(0, busy_tokens, HOLDERS),))
        pool.commit(filler)   # committed first: its chunk holds H before the question's turn
        busy = threading.Thread(target=pool.run, args=(filler, _tokens(busy_tokens, 99)))
        busy.start()
    pool.commit(plan)
    t0 = time.perf_counter()
    res = pool.run(plan, ids)
    took = time.perf_counter() - t0
    if busy is not None:
        busy.join()
        pool.release(f"{rid}-busy")
    pool.release(rid)
    return took, res.first_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--busy-tokens", type=int, default=3072)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    pool = PrefillPool(load_deployment("tiny-cpu.toml"), num_instances=4, node_size=2,
                       timeout_s=120.0)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for rep in range(args.repeats):
            doc = _tokens(args.doc_tokens, 2 * rep)
            source = f"doc{rep}"
            pool.run(PrefillPlan(source, len(doc), (Chunk(0, len(doc), HOLDERS),)), doc)
            ids = doc + _tokens(args.question_tokens, 2 * rep + 1)
            firsts = set()
            # alternate the order of the placements so that none always runs first
            order = PLACEMENTS if rep % 2 == 0 else PLACEMENTS[::-1]
            for load, busy in (("idle", 0), ("busy", args.busy_tokens)):
                for placement in order:
                    took, first = _question(pool, placement, f"q{rep}-{load}-{placement}", ids,
                                            args.doc_tokens, source, busy)
                    times.setdefault((load, placement), []).append(took)
                    firsts.add(first)
            assert len(firsts) == 1, f"repeat {rep}: first tokens differ: {firsts}"
            pool.release(source)
        assert not any(pool.held_requests().values()), pool.held_requests()
    finally:
        pool.shutdown()
        ray.shutdown()
    med = {f"{load}/{p}": statistics.median(v) for (load, p), v in times.items()}
    ratios = {f"{load}/{p}:extend": med[f"{load}/{p}"] / med[f"{load}/extend"]
              for load in ("idle", "busy") for p in PLACEMENTS}
    out = {"args": vars(args), "median_s": med, "ratios": ratios,
           "runs_s": {f"{k[0]}/{k[1]}": v for k, v in times.items()}}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for load in ("idle", "busy"):
        print(f"holders {load}: " + ", ".join(
            f"{p} {med[f'{load}/{p}']:.3f} s (x{ratios[f'{load}/{p}:extend']:.3f})"
            for p in PLACEMENTS))


if __name__ == "__main__":
    main()
