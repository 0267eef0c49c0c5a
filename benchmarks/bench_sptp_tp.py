"""SP-TP beside the ring and SP-NTP on a pool of TP-2 instances (CPU, gloo), side by side in
one run, with the cost model's volumes for the same chunk.

``--tp`` processes are the TP ranks; in each, ``--instances`` instances are threads
(``actors/prefill/threaded_tp.py``). Per layout, a plan puts ``--history`` tokens on one
instance and then a chunk of ``--tokens`` on all of them, run with that layout (cache
balancing spreads the history first). Reported per layout: the median over ``--repeats`` of
the chunk's time (the slowest member, TP rank 0's view), its ratio to the ring's, the elements
one head slice's world sent (``PrefillResult.sent_elements``), what ``sp_comm.layout_volume``
charges for it (per-instance geometry, all layers), and the last-token logits' largest
relative difference from the single (TP-1) engine. Every process shares this machine's cores:
the times are of this machine under its load, the ratios are what the run measures.

    OMP_NUM_THREADS=1 python benchmarks/bench_sptp_tp.py [--instances 4 --history 1024 --tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYOUTS = ("ring", "a2a", "sptp")


def _prompt(n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _rank(rank: int, args, store_path: str, out_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from tetris.actors.prefill.layout import forced_plan
    from tetris.actors.prefill.threaded_tp import ThreadedTpRank, instance_tp_groups

    from tetris.config import load_deployment

    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.tp), rank=rank,
                            world_size=args.tp)
    try:
        model_cfg = load_deployment("tiny-cpu.toml").model
        n = args.history + args.tokens
        blocks = 2 * (n // 16 + 2)
        pool = ThreadedTpRank(model_cfg, instance_tp_groups(args.instances), num_blocks=blocks,
                              block_size=16, timeout_s=120.0)
        out = {}
        for lay in LAYOUTS:
            spec = f"{args.history}x1,restx{args.instances}:{lay}"
            times, res = [], None
            for k in range(args.repeats + 1):   # the first run warms up
                plan = forced_plan(f"{lay}-{k}", n, spec, (0,) * args.instances)
                res = pool.run(plan, _prompt(n), return_logits=True)
                pool.release(plan.request_id)
                if k:
                    times.append(res.chunk_elapsed_s[-1])
            out[lay] = {"times": times, "sent": res.sent_elements, "logits": res.logits}
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _reference_logits(n: int) -> torch.Tensor:
    from tetris.kernels.attention import attention_with_lse

    from tetris.config import load_deployment
    from tetris.model.loader import load_model

    model = load_model(load_deployment("tiny-cpu.toml").model)[0]
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(_prompt(n)), torch.arange(n),
                               lambda i, q, k, v: attention_with_lse(q, k, v, causal=True)[0])
        return model.logits(hidden[-1:])[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from tetris.config import load_deployment
    from tetris.scheduler.sp_comm import ModelGeometry, layout_volume

    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "out.json")
        mp.spawn(_rank, args=(args, os.path.join(d, "store"), out_path), nprocs=args.tp)
        with open(out_path) as f:
            out = json.load(f)
    g = ModelGeometry.from_model_config(load_deployment("tiny-cpu.toml").model, args.tp)
    ref = _reference_logits(args.history + args.tokens)
    ring = statistics.median(out["ring"]["times"])
    print(f"TP-{args.tp} instances x{args.instances}, history {args.history} on one instance, "
          f"chunk {args.tokens} tokens; {args.repeats} repeats (CPU, gloo; this machine's load)")
    print(f"{'layout':7} {'chunk s':>9} {'vs ring':>8} {'sent/slice':>11} {'model':>11} "
          f"{'logits rel':>10}")
    for lay in LAYOUTS:
        r = out[lay]
        t = statistics.median(r["times"])
        model = g.num_layers * layout_volume(lay, g, args.instances, args.history, args.tokens)
        rel = ((torch.tensor(r["logits"]) - ref).abs().max() / ref.abs().max()).item()
        print(f"{lay:7} {t:9.3f} {t / ring:8.2f} {r['sent']:11d} {model:11.0f} {rel:10.1e}")


if __name__ == "__main__":
    main()
