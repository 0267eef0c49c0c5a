"""Elastic decode's live path (tetris/engine/elastic_rows.py), CPU: the decode-round time of a
long request whose KV is split over two decode instances vs the same request on one.

    python benchmarks/bench_elastic_live.py [--context 16384] [--others 4] [--rounds 30]
        [--repeats 3] [--json]

Two processes, one decode instance each (TP 1, one intra-op thread), joined by a gloo group
for the exchange, each running its own ``LLMEngine`` with ``--others`` short requests of its
own. Instance 0 also runs one ``--context``-token request:

- ``whole``: all of its KV on instance 0 (the elastic world is joined; nothing to exchange);
- ``split``: instance 0 masters it with ``[context/2, context)``, instance 1 holds
  ``[0, context/2)`` and answers instance 0's queries between its own layers;
- ``plain`` (instance 0 alone, afterwards): the whole request on an engine with no elastic
  world at all (the hook's own cost).

The round time is each instance's ``ElasticRows.round`` (engine step plus exchanges), median
over ``--rounds`` rounds, setups alternated ``--repeats`` times in one run. KV contents are
left as allocated (timing does not depend on values). CPU figures on a shared machine:
the ratios are what to read, and only side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tetris.config import ModelConfig
from tetris.engine.elastic_rows import ElasticRows
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

BS = 16
OTHER_TOKENS = 256


def model_config(context: int) -> ModelConfig:
    """The served tiny cluster's geometry (tests/cluster_configs.py), long enough a context."""
    return ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=4,
                       num_heads=8, num_kv_heads=2, max_position_embeddings=2 * context, seed=0)


class _Peers:
    def __init__(self, path: str, index: int) -> None:
        self.group = dist.ProcessGroupGloo(dist.FileStore(path, 2), index, 2,
                                           timedelta(seconds=120))

    def isend(self, tensor, peer, tag):
        return self.group.send([tensor], peer, tag)

    def irecv(self, tensor, peer, tag):
        return self.group.recv([tensor], peer, tag)


def _engine(model, blocks: int) -> LLMEngine:
    return LLMEngine(model, None, num_blocks=blocks, block_size=BS, max_num_seqs=16)


def _place(engine, rid: str, n: int, params, kv_start: int = 0) -> None:
    """A prefilled request of ``n`` tokens whose KV from ``kv_start`` is here."""
    engine.reserve_blocks(rid, [1] * n, params, kv_start=kv_start)
    engine.commit_prefilled(rid, 2)


def _setup(me: int, model, link, args, split: bool):
    params = SamplingParams(max_tokens=args.rounds + 1, temperature=0.0, ignore_eos=True)
    engine = _engine(model, args.blocks)
    rows = ElasticRows(engine, me, 2, link)
    for i in range(args.others):
        _place(engine, f"o{me}-{i}", OTHER_TOKENS, params)
    half = args.context // 2
    if me == 0:
        _place(engine, "long", args.context, params, kv_start=half if split else 0)
        if split:
            rows.master("long", 1, [1])
    elif split:
        rows.hold("long", 1, 0, 0, half)
    return engine, rows


def _rounds(rows, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        rows.round()
        times.append(time.perf_counter() - t0)
    return times


def _worker(me: int, tmp: str, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    model, _ = load_model(model_config(args.context))
    link = _Peers(f"{tmp}/x", me)
    out = {"whole": [], "split": [], "plain": [], "bytes_per_round": {}}
    for _ in range(args.repeats):
        for name in ("whole", "split"):
            engine, rows = _setup(me, model, link, args, name == "split")
            d0 = rows.counts.data
            out[name].append(statistics.median(_rounds(rows, args.rounds)))
            out["bytes_per_round"][name] = (rows.counts.data - d0) / args.rounds
            del engine, rows
    if me == 0:
        params = SamplingParams(max_tokens=args.rounds + 1, temperature=0.0, ignore_eos=True)
        for _ in range(args.repeats):
            engine = _engine(model, args.blocks)
            for i in range(args.others):
                _place(engine, f"o{i}", OTHER_TOKENS, params)
            _place(engine, "long", args.context, params)
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            out["plain"].append(statistics.median(times))
    with open(f"{tmp}/out{me}.json", "w") as f:
        json.dump(out, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--others", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.blocks = (args.context + args.others * OTHER_TOKENS) // BS + 8 * (args.others + 2)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(tmp, args), nprocs=2)
        res = [json.loads(Path(f"{tmp}/out{me}.json").read_text()) for me in range(2)]
    ms = {me: {k: [1e3 * t for t in res[me][k]] for k in ("whole", "split", "plain")}
          for me in range(2)}
    summary = {
        "context": args.context, "others_per_instance": args.others, "rounds": args.rounds,
        "master_ms": {k: statistics.median(v) for k, v in ms[0].items()},
        "holder_ms": {k: statistics.median(v) for k, v in ms[1].items() if v},
        "runs_ms": ms, "exchange_bytes_per_round": res[0]["bytes_per_round"],
    }
    m = summary["master_ms"]
    summary["split_over_whole"] = m["split"] / m["whole"]
    summary["whole_over_plain"] = m["whole"] / m["plain"]
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    h = summary["holder_ms"]
    print(f"CPU, live path, {args.context}-token request + {args.others} x {OTHER_TOKENS}-token "
          f"requests per instance, median of {args.repeats} medians of {args.rounds} rounds")
    print(f"  master round: whole {m['whole']:.2f} ms, split {m['split']:.2f} ms "
          f"(x{summary['split_over_whole']:.2f}); plain engine {m['plain']:.2f} ms "
          f"(elastic world joined, nothing to exchange: x{summary['whole_over_plain']:.2f})")
    print(f"  holder round: whole {h['whole']:.2f} ms, split {h['split']:.2f} ms")
    print(f"  exchange bytes per round (instance 0 sends): {res[0]['bytes_per_round']}")


if __name__ == "__main__":
    main()
