"""Elastic decode's live path (tetris/engine/elastic_rows.py), CPU: the decode-round time of a
long request whose KV is split over two decode instances vs the same request on one.

    python benchmarks/bench_elastic_live.py [--context 16384] [--others 4] [--rounds 30]
        [--repeats 3] [--json] [--emulated configs/paper-llama3-8b-emulated.toml]

Two processes, one decode instance each (TP 1, one intra-op thread), joined for the exchange
by ``--link`` (socket: actors/decode/elastic_link.py, the decode ranks' link; gloo), each running its own ``LLMEngine`` with ``--others`` short requests of its
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

``--emulated DEPLOYMENT``: EMULATION (actors/decode/elastic_emulated.py): the deployment's
decode instances as emulated engines (the decode latency model's step time for its TP size,
slept layer by layer, over the KV each instance reads: a master its own range, a holder also
the ranges it is asked about), exchanging the paper geometry's q and partials (one TP rank's
head slice) over the same gloo link. ``plain`` is then the emulated engine with no elastic
world (one sleep per step).
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

import msgspec
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


def _emulated_engine(deployment):
    from tetris.actors.decode.elastic_emulated import EmulatedElasticEngine

    dc, mc = deployment.decode, deployment.model
    return EmulatedElasticEngine(deployment, tp_size=dc.tp_size,
                                 kv_heads=mc.num_kv_heads // dc.tp_size)


def _new(me: int, model, link, args, elastic: bool = True):
    """(engine, its ElasticRows or None) for a setup: live model or EMULATION."""
    if args.emulated:
        from tetris.actors.decode.elastic_emulated import EmulatedElasticRows

        engine = _emulated_engine(model)
        return engine, EmulatedElasticRows(engine, me, 2, link) if elastic else None
    engine = _engine(model, args.blocks)
    return engine, ElasticRows(engine, me, 2, link) if elastic else None


def _setup(me: int, model, link, args, split: bool):
    params = SamplingParams(max_tokens=args.rounds + 1, temperature=0.0, ignore_eos=True)
    engine, rows = _new(me, model, link, args)
    for i in range(args.others):
        _place(engine, f"o{me}-{i}", args.other_tokens, params)
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
    if args.emulated:
        from tetris.config import load_deployment

        dep = load_deployment(args.emulated)   # the deployment stands in for the model
        # emulation has no positional limit of its own (configs/paper-llama3-8b-emulated.toml)
        longest = max(dep.model.max_position_embeddings, 2 * args.context)
        model = msgspec.structs.replace(dep, model=msgspec.structs.replace(
            dep.model, max_position_embeddings=longest))
    else:
        model, _ = load_model(model_config(args.context))
    if args.link == "gloo":
        link = _Peers(f"{tmp}/x", me)
    else:
        from tetris.actors.decode.elastic_link import SocketWorld

        link = SocketWorld(dist.FileStore(f"{tmp}/x", 2), me, 2, "127.0.0.1", 120.0)
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
            engine, _ = _new(me, model, link, args, elastic=False)
            for i in range(args.others):
                _place(engine, f"o{i}", args.other_tokens, params)
            _place(engine, "long", args.context, params)
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            out["plain"].append(statistics.median(times))
    with open(f"{tmp}/out{me}.json", "w") as f:
        json.dump(out, f)


def modeled_rounds(args) -> dict[str, float]:
    """The master's round by the decode latency model alone: whole, it reads every token of
    its batch; split, the slower of it (its half) and the holder (its batch and the other
    half), as the emulated engines sleep it."""
    from tetris.actors.decode.emulated import decode_model_spec

    from tetris.config import load_deployment
    from tetris.scheduler.decode_latency import DecodeLatencyModel

    dep = load_deployment(args.emulated)
    lat, tp = DecodeLatencyModel(decode_model_spec(dep.model)), dep.decode.tp_size
    own, half, batch = args.others * args.other_tokens, args.context // 2, args.others + 1
    whole = lat.step_time(tp, batch, own + args.context)
    split = max(lat.step_time(tp, batch, own + args.context - half),
                lat.step_time(tp, args.others, own + half))
    return {"whole": 1e3 * whole, "split": 1e3 * split}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--others", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--other-tokens", type=int, default=OTHER_TOKENS)
    ap.add_argument("--emulated", metavar="DEPLOYMENT", default=None)
    ap.add_argument("--link", choices=["socket", "gloo"], default="socket",
                    help="the elastic world's transport (actors/decode/elastic_link.py)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.blocks = (args.context + args.others * args.other_tokens) // BS + 8 * (args.others + 2)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(tmp, args), nprocs=2)
        res = [json.loads(Path(f"{tmp}/out{me}.json").read_text()) for me in range(2)]
    ms = {me: {k: [1e3 * t for t in res[me][k]] for k in ("whole", "split", "plain")}
          for me in range(2)}
    summary = {
        "mode": f"EMULATION {args.emulated}" if args.emulated else "CPU", "link": args.link,
        "context": args.context, "others_per_instance": args.others, "rounds": args.rounds,
        "master_ms": {k: statistics.median(v) for k, v in ms[0].items()},
        "holder_ms": {k: statistics.median(v) for k, v in ms[1].items() if v},
        "runs_ms": ms, "exchange_bytes_per_round": res[0]["bytes_per_round"],
    }
    m = summary["master_ms"]
    summary["split_over_whole"] = m["split"] / m["whole"]
    if args.emulated:
        summary["modeled_ms"] = modeled_rounds(args)
    summary["whole_over_plain"] = m["whole"] / m["plain"]
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    if args.emulated:
        mm = summary["modeled_ms"]
        print(f"  the decode latency model alone (no exchange, no lockstep): whole "
              f"{mm['whole']:.2f} ms, split {mm['split']:.2f} ms "
              f"(x{mm['split'] / mm['whole']:.2f})")
    h = summary["holder_ms"]
    label = f"EMULATION ({args.emulated})" if args.emulated else "CPU, live path"
    label += f", {args.link} link"
    print(f"{label}, {args.context}-token request + {args.others} x {args.other_tokens}-token "
          f"requests per instance, median of {args.repeats} medians of {args.rounds} rounds")
    print(f"  master round: whole {m['whole']:.2f} ms, split {m['split']:.2f} ms "
          f"(x{summary['split_over_whole']:.2f}); plain engine {m['plain']:.2f} ms "
          f"(elastic world joined, nothing to exchange: x{summary['whole_over_plain']:.2f})")
    print(f"  holder round: whole {h['whole']:.2f} ms, split {h['split']:.2f} ms")
    print(f"  exchange bytes per round (instance 0 sends): {res[0]['bytes_per_round']}")


if __name__ == "__main__":
    main()
