"""CPU cost of placing KV pieces on a decode rank, per piece, before and after session 11.

A decode rank's transfer pump places every arriving piece into its paged cache
(``ReceiveManager._place``) and checks whether the piece completed its chunk or its request
(``_check_complete``). Until session 11 each piece

- mapped its positions to cache slots through the block table (``positions_to_slots``: a
  copy of the table and ~10 small tensor ops), and
- scanned the chunk's and the request's whole coverage (``layers x tokens`` booleans) for
  completion: a cost that grows with the prompt, paid by every piece, so quadratic in the
  prompt per request.

Now a shard maps its positions once (``IncomingShard.slots``; a piece takes a slice), and
completion is read from counts (``IncomingRequest.cover``), with one scan to confirm it per
chunk. Both paths run here side by side on the same pieces, in one process: the "before"
path is the old code inlined (labelled as such); "after" is the code the receive manager runs.
The geometry is one TP rank of a LLaMA3-8B decode instance at TP 8 (1 KV head of 128, bf16:
512 bytes a token, so a 1 MiB slot carries 2048 tokens), 32 layers, one chunk on SP 8.

    python benchmarks/bench_receive_path.py
    python benchmarks/bench_receive_path.py --prompts 16384,131072 --json

On CPU the copy itself (1 MiB a piece) is most of the time; "bookkeeping only" runs both
paths without it: the part a GPU's fast copy does not hide (and all of it in emulation, whose
cache is on the meta device).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from tetris.kernels.kv_pack import positions_to_slots, scatter_kv
from tetris.transfer.messages import Handshake, TokenRange
from tetris.transfer.protocol import IncomingRequest, IncomingShard

LAYERS, HKV, D, BLOCK = 32, 1, 128, 16
PIECE = (1 << 20) // (2 * HKV * D * 2)   # tokens of one 1 MiB slot, bf16 K and V
SP = 8


def _setup(prompt: int):
    blocks = list(np.random.default_rng(0).permutation(prompt // BLOCK + 1).tolist())
    req = IncomingRequest("r", prompt, LAYERS, blocks, BLOCK, now=0.0)
    req.chunks[0] = (0, prompt)
    bounds = np.linspace(0, prompt, SP + 1).astype(int)
    shards = []
    for s in range(SP):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        hs = Handshake("r", s, 0, 0, 0, prompt, prompt, (TokenRange(lo, hi),), LAYERS, HKV, D,
                       "bfloat16", f"prefill-{s}")
        shards.append(IncomingShard(hs, np.arange(lo, hi, dtype=np.int64), s, PIECE))
    nb = len(blocks)
    caches = [(torch.zeros(nb, BLOCK, HKV, D, dtype=torch.bfloat16),
               torch.zeros(nb, BLOCK, HKV, D, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    pieces = [(layer, shard, off, min(PIECE, shard.positions.size - off))
              for layer in range(LAYERS) for shard in shards
              for off in range(0, shard.positions.size, PIECE)]
    packed = torch.ones(PIECE, 2, HKV, D, dtype=torch.bfloat16)
    return req, shards, caches, pieces, packed


def before(prompt: int, copy: bool = True) -> tuple[float, int, bool]:
    """The per-piece path as it was until session 11 (inlined here to compare)."""
    req, _shards, caches, pieces, packed = _setup(prompt)
    t0 = time.perf_counter()
    for layer, shard, off, n in pieces:
        positions = shard.positions_t[off:off + n]
        slots = positions_to_slots(req.block_table, positions, BLOCK)
        if copy:
            scatter_kv(*caches[layer], slots, packed[:n])
        shard.mark_received(layer, off, n)
        req.coverage[layer, shard.positions[off:off + n]] = True
        start, end = req.chunks[0]
        chunk_done = bool(req.coverage[:, start:end].all())
        done = bool(req.coverage.all())
    return time.perf_counter() - t0, len(pieces), chunk_done and done


def after(prompt: int, copy: bool = True) -> tuple[float, int, bool]:
    """The per-piece path the receive manager runs now."""
    req, _shards, caches, pieces, packed = _setup(prompt)
    t0 = time.perf_counter()
    for layer, shard, off, n in pieces:
        piece = slice(off, off + n)
        slots = shard.slots(req.block_table, BLOCK)[piece]
        if copy:
            scatter_kv(*caches[layer], slots, packed[:n])
        shard.mark_received(layer, off, n)
        req.cover(layer, shard.positions[piece], 0)
        chunk_done = req.chunk_complete(0)
        done = req.complete
    return time.perf_counter() - t0, len(pieces), chunk_done and done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="16384,65536,131072",
                    help="prompt lengths, comma-separated (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="best of N (default %(default)s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for prompt in [int(p) for p in args.prompts.split(",")]:
        b = min(before(prompt) for _ in range(args.repeats))
        a = min(after(prompt) for _ in range(args.repeats))
        bk = min(before(prompt, copy=False) for _ in range(args.repeats))
        ak = min(after(prompt, copy=False) for _ in range(args.repeats))
        if not all(r[2] for r in (a, b, ak, bk)):
            raise SystemExit(f"prompt {prompt}: a path did not see the request complete")
        per = 1e6 / a[1]
        rows.append({"prompt_tokens": prompt, "pieces": a[1],
                     "before_us_per_piece": b[0] * per, "after_us_per_piece": a[0] * per,
                     "ratio": b[0] / a[0],
                     # the bookkeeping alone (no copy into the cache): what a GPU does not hide
                     "bookkeeping_before_us": bk[0] * per, "bookkeeping_after_us": ak[0] * per,
                     "bookkeeping_ratio": bk[0] / ak[0],
                     "before_s_per_request": b[0], "after_s_per_request": a[0]})
    if args.json:
        print(json.dumps({"geometry": {"layers": LAYERS, "kv_heads": HKV, "head_dim": D,
                                       "piece_tokens": PIECE, "sp": SP}, "rows": rows}))
        return
    print(f"one decode TP rank, {LAYERS} layers, {HKV} KV head x {D}, bf16, pieces of {PIECE} "
          f"tokens, one chunk on SP {SP}; best of {args.repeats}, side by side")
    print(f"{'prompt':>8} {'pieces':>7} | {'with the copy, us/piece: before':>32} {'after':>7} "
          f"{'ratio':>6} | {'bookkeeping only: before':>25} {'after':>7} {'ratio':>6}")
    for r in rows:
        print(f"{r['prompt_tokens']:>8} {r['pieces']:>7} | {r['before_us_per_piece']:>32.1f} "
              f"{r['after_us_per_piece']:>7.1f} {r['ratio']:>5.1f}x | "
              f"{r['bookkeeping_before_us']:>25.1f} {r['bookkeeping_after_us']:>7.1f} "
              f"{r['bookkeeping_ratio']:>5.1f}x")


if __name__ == "__main__":
    main()
