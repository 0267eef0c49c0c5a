"""Memory a process holds for long prompts in flight: Python-int tuples vs one int32 buffer.

What the dispatcher process holds per in-flight request, before and after issue #7's change:

- ``tuple``: the ``GenerateRequest`` as unpickled from the ingress (a tuple of Python ints) plus
  the ``list(prompt)`` copy it kept for the prefill pool for the whole request (the old code);
- ``int32``: the ``GenerateRequest`` as unpickled, its prompt one ``array('i')``, handed to
  both pools as is (the new code).

Each mode runs in a fresh process (RSS from /proc/self/statm): RSS after receiving and holding
``--requests`` prompts of ``--tokens`` tokens, and after dropping them (what pymalloc keeps).

    nice -n 19 python3 benchmarks/bench_prompt_hop_memory.py --requests 24 --tokens 24000 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import random
import subprocess
import sys

import msgspec

from tetris.sampling_params import SamplingParams
from tetris.serve.protocol import GenerateRequest


class _TupleRequest(msgspec.Struct, frozen=True):
    """The old ``GenerateRequest`` field layout (prompt as a tuple of Python ints)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _wire(mode: str, requests: int, tokens: int, seed: int) -> list[bytes]:
    """What the ingress sends for each request (pickled, as Ray Serve sends it)."""
    rng = random.Random(seed)
    out = []
    for r in range(requests):
        ids = [rng.randrange(128_256) for _ in range(tokens)]   # Llama-3 vocabulary ids
        if mode == "tuple":
            req = _TupleRequest(f"r{r}", tuple(ids), SamplingParams())
        else:
            req = GenerateRequest(f"r{r}", ids, SamplingParams())
        out.append(pickle.dumps(req, protocol=5))
        del ids, req
    return out


def _child(mode: str, requests: int, tokens: int, seed: int) -> dict:
    wire = _wire(mode, requests, tokens, seed)
    gc.collect()
    base = _rss_mb()
    held = []
    for blob in wire:
        req = pickle.loads(blob)
        # the old dispatcher kept list(prompt) for the prefill pool for the whole request
        copy = list(req.prompt_token_ids) if mode == "tuple" else req.prompt_token_ids
        held.append((req, copy))
    holding = _rss_mb()
    del held, req, copy
    gc.collect()
    after = _rss_mb()
    return {"mode": mode, "wire_bytes_per_request": sum(map(len, wire)) / len(wire),
            "held_mb": holding - base, "retained_after_free_mb": after - base,
            "held_bytes_per_token": (holding - base) * 2**20 / (requests * tokens)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=24_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=["tuple", "int32"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.requests <= 0 or args.tokens <= 0:
        ap.error("--requests and --tokens must be positive")
    if args.child:
        print(json.dumps(_child(args.child, args.requests, args.tokens, args.seed)))
        return
    rows = {}
    for mode in ("tuple", "int32"):
        cmd = [sys.executable, __file__, "--child", mode, "--requests", str(args.requests),
               "--tokens", str(args.tokens), "--seed", str(args.seed)]
        rows[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                               text=True).stdout)
    small = rows["int32"]["held_mb"]
    # RSS moves in pages: a tiny run may hold too little to see (no ratio then)
    ratio = rows["tuple"]["held_mb"] / small if small > 0 else None
    result = {"requests": args.requests, "tokens": args.tokens, "modes": rows,
              "held_ratio_tuple_over_int32": ratio}
    if args.json:
        print(json.dumps(result))
        return
    for mode, r in rows.items():
        print(f"{mode:6s} wire {r['wire_bytes_per_request'] / 1e3:8.1f} KB/request  "
              f"held {r['held_mb']:7.1f} MB ({r['held_bytes_per_token']:5.1f} B/token)  "
              f"retained after free {r['retained_after_free_mb']:7.1f} MB")
    if ratio is not None:
        print(f"held: tuple / int32 = {ratio:.1f}x")


if __name__ == "__main__":
    main()
