"""Served KunServe members on CPU: a decode step as a replica vs as a dropped group's member.

    python benchmarks/bench_kunserve_members.py [--layers 8] [--hidden 256] [--batch 8]
        [--steps 20] [--repeats 3] [--bulk-mib 0]

Two engines of one seeded model, each with ``batch`` running requests. ``replica``: each
engine steps its own batch with every layer. ``group``: the two are dropped into one group
(``actors/decode/pipeline_stage.GroupMember``, real TCP links on loopback), each keeps half
of the layers, and each step of a member runs its layers here and the other half on the
other member (its link thread), the hidden states going there and back as activations. The
two engines step in turn from one thread, as in ``replica``. With ``--bulk-mib``, a bulk
transfer of that size is queued on each link before the group's steps (a landing forward's
or an exchange's traffic): activations pass it at chunk boundaries. Reported side by side in
one run: median step time per mode and group / replica, the exchange's KV bytes, activation
bytes per step. Tokens of both modes are checked equal. CPU timing on a shared machine: the
ratio, not the absolute times, is the figure.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
from tetris.actors.decode.pipeline_stage import GroupMember, member_blocks
from tetris.transfer.traffic import TrafficClass

from tetris.config import ModelConfig
from tetris.engine.engine import LLMEngine
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams


def _engines(cfg: ModelConfig, batch: int, max_tokens: int) -> list[LLMEngine]:
    engines = []
    for j in range(2):
        model, _ = load_model(cfg)
        e = LLMEngine(model, num_blocks=batch * 40, block_size=16, max_num_seqs=batch)
        for i in range(batch):
            prompt = [(7 * i + 3 * j + k) % cfg.vocab_size for k in range(16 + 8 * i)]
            e.add_request(f"{j}-{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                             temperature=0.0, ignore_eos=True))
        engines.append(e)
    return engines


def _steps(engines, n: int, tokens: dict) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        for e in engines:
            for out in e.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        times.append((time.perf_counter() - t0) / len(engines))
    return times


def _parallel(fns) -> list:
    out = [None] * len(fns)
    threads = [threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f()))
               for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run(args) -> dict:
    cfg = ModelConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_layers=args.layers, num_heads=8, num_kv_heads=4, seed=3)
    total = args.steps + 4
    replica_tokens: dict = {}
    replica = _engines(cfg, args.batch, total)
    _steps(replica, 2, replica_tokens)                      # prefill and warm-up
    t_replica = _steps(replica, args.steps, replica_tokens)
    group_tokens: dict = {}
    engines = _engines(cfg, args.batch, total)
    _steps(engines, 2, group_tokens)
    half = args.layers // 2
    ranges = [(0, half), (half, args.layers)]
    g = min(member_blocks(e, *r) for e, r in zip(engines, ranges, strict=True))
    members = [GroupMember(e, j, "127.0.0.1") for j, e in enumerate(engines)]
    addrs = [m.address for m in members]
    _parallel([lambda m=m: m.connect(addrs, 10.0) for m in members])
    t0 = time.perf_counter()
    _parallel([lambda m=m: m.drop(ranges, g, [(0, g // 2), (g // 2, g)]) for m in members])
    drop_s = time.perf_counter() - t0
    if args.bulk_mib:
        blob = np.zeros(args.bulk_mib << 20, dtype=np.uint8)
        for m in members:   # a bulk item the peer reads and drops (kind "bulk-test")
            m.links.send(m.links.peers[0], {"kind": "bulk-test", "blob": blob}, TrafficClass.BULK)
    act0 = [m.links.sent_bytes[TrafficClass.ACTIVATION] for m in members]
    t_group = _steps(engines, args.steps, group_tokens)
    act = sum(m.links.sent_bytes[TrafficClass.ACTIVATION] - a for m, a in zip(members, act0,
                                                                               strict=True))
    exchange = sum(m.exchange_bytes for m in members)
    for m in members:
        m.close()
    same = all(group_tokens[k] == replica_tokens[k][:len(group_tokens[k])] for k in group_tokens)
    return {"replica_step_s": statistics.median(t_replica),
            "group_step_s": statistics.median(t_group), "drop_s": drop_s,
            "exchange_bytes": exchange, "activation_bytes_per_step": act / args.steps / 2,
            "tokens_equal": same}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bulk-mib", type=int, default=0)
    args = p.parse_args()
    print("repeat  replica_ms  group_ms  group/replica  drop_s  exchange_KiB  act_KiB/step  "
          "tokens_equal")
    ratios = []
    for r in range(args.repeats):
        res = run(args)
        ratio = res["group_step_s"] / res["replica_step_s"]
        ratios.append(ratio)
        print(f"{r:6d}  {res['replica_step_s'] * 1e3:10.2f}  {res['group_step_s'] * 1e3:8.2f}  "
              f"{ratio:13.2f}  {res['drop_s']:6.2f}  {res['exchange_bytes'] / 1024:12.0f}  "
              f"{res['activation_bytes_per_step'] / 1024:12.1f}  {res['tokens_equal']}")
    print(f"median group/replica step time: {statistics.median(ratios):.2f} "
          f"(CPU, in process, loopback TCP links)")


if __name__ == "__main__":
    main()
