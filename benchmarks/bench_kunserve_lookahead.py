"""Lookahead micro-batches in a served KunServe group on CPU: an uneven batch with and without.

    OMP_NUM_THREADS=1 python benchmarks/bench_kunserve_lookahead.py [--layers 8] [--hidden 256]
        [--long 3] [--long-tokens 2048] [--short 9] [--steps 16] [--repeats 3]

Two engines of one seeded model dropped into a group of 2 (``GroupMember``, loopback TCP
links, the chain of ``actors/decode/stage_chain.py``), each member stepping its own batch in
its own thread as the served ranks do (one process here: the threads share the GIL, which
served ranks, separate processes, do not). The batch is uneven: member 0 holds ``long``
requests of ``long-tokens`` context and ``short`` of 32, member 1 one short request at a time
(little work). Modes, side by side in each repeat: ``one`` (one micro-batch per step, as
without lookahead); ``count-g`` (g = 2 micro-batches of equal sequence counts, the
token-budget baseline); ``lookahead-g`` (2, cost-balanced by ``decode_cost_model``, §4.3);
``lookahead-g-serial`` (the same micro-batches one at a time in the chain); ``lookahead``
(as many as ``micro_batch_count`` asks for with Eq. (2)'s load per micro-batch fitted from
the ``one`` and ``lookahead-g-serial`` runs: ``fitted_overhead``). Two effects are apart this way:
``lookahead-g-serial / one`` is what the micro-batches' composition alone gives (on CPU the
torch decode path pads every row of a micro-batch to its longest context, so long and short
rows apart cost less; a GPU paged kernel does not pad), ``lookahead-g / lookahead-g-serial``
what their overlap across the two members gives (at best (k + g - 1) / (k g), 0.75 for k =
g = 2: a step samples every row before the next starts). ``--long 0 --short 12``: equal
contexts, no padding. Reported per mode: member 0's median step time, its ratio to ``one``,
the bubble share ``1 - stage busy seconds / (2 * wall)`` over the measured window (busy:
each member's own layers' runs), micro-batches per step; member 0's tokens are checked
equal across modes. CPU timing: the ratios and the load average are the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
from tetris.actors.decode.pipeline_stage import GroupMember, member_blocks

from tetris.config import ModelConfig
from tetris.engine.engine import LLMEngine
from tetris.engine.pipeline import layer_bytes
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams
from tetris.scheduler.member_lookahead import MemberLookahead, decode_cost_model

# mode -> (balanced, fixed count: None = by the group's load and the fitted load per
# micro-batch, one at a time)
MODES = {"one": None, "count-g": (False, 2, False), "lookahead-g": (True, 2, False),
         "lookahead-g-serial": (True, 2, True), "lookahead": (True, None, False)}
_MEMBER1_BLOCKS = 16   # member 1's part of the group's blocks: one short request at a time


def _lens(args) -> list[list[int]]:
    return [[args.long_tokens] * args.long + [32] * args.short, [32]]


def _engines(cfg: ModelConfig, args) -> list[LLMEngine]:
    total = args.steps + 8
    lens = _lens(args)
    engines = []
    for j, member_lens in enumerate(lens):
        model, _ = load_model(cfg)
        blocks = sum(n + total for n in lens[0]) // 16 + 2 * _MEMBER1_BLOCKS   # alike
        e = LLMEngine(model, num_blocks=blocks, block_size=16, max_num_seqs=len(member_lens))
        for i, n in enumerate(member_lens):
            prompt = [(7 * i + 3 * j + k) % cfg.vocab_size for k in range(n)]
            e.add_request(f"{j}-{i}", prompt, _params(total))
        engines.append(e)
    return engines


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _parallel(fns) -> list:
    """Run each function in its own thread; re-raise the first error."""
    out, errors = [None] * len(fns), []

    def run(i, f):
        try:
            out[i] = f()
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _timed(stage, busy: list[float]):
    run = stage.run

    def timed(*a):
        t0 = time.perf_counter()
        try:
            return run(*a)
        finally:
            busy.append(time.perf_counter() - t0)
    return timed


def fitted_overhead(cfg: ModelConfig, args, one: dict, serial: dict) -> float:
    """Eq. (2)'s load per micro-batch, in sequences, from two runs of member 0's batch: as
    one micro-batch (``one``: s * work + e) and as two run one after the other (``serial``:
    s * work + 2 e, plus whatever the composition saves), so e = serial - one and s = (one -
    e) / work, work = sum(alpha ctx + 1) at the middle of the measured window."""
    cost = decode_cost_model(cfg.hidden_size, one["layer_params"], 0.0)
    mid = args.steps // 2 + 2
    work = sum(cost.alpha * (n + mid) + 1 for n in _lens(args)[0])
    extra = max(0.0, serial["step_s"] - one["step_s"])
    scale = (one["step_s"] - extra) / work
    return extra / scale if scale > 0 else float("inf")


def _drop(engines, layers: int, plan) -> list[GroupMember]:
    """The two engines as one group, half of the layers each."""
    ranges = [(0, layers // 2), (layers // 2, layers)]
    g = min(member_blocks(e, *r) for e, r in zip(engines, ranges, strict=True))
    members = [GroupMember(e, j, "127.0.0.1", lookahead=plan) for j, e in enumerate(engines)]
    addrs = [m.address for m in members]
    _parallel([lambda m=m: m.connect(addrs, 10.0) for m in members])
    parts = [(0, g - _MEMBER1_BLOCKS), (g - _MEMBER1_BLOCKS, g)]
    _parallel([lambda m=m: m.drop(ranges, g, parts) for m in members])
    return members


def run_mode(cfg: ModelConfig, args, mode: str, overhead_seqs: float = 0.0) -> dict:
    engines = _engines(cfg, args)
    while any(s.num_computed < len(s.prompt_token_ids) for e in engines
              for s in e._seqs.values()):
        for e in engines:
            e.step()                     # prefill, before the drop
    layer = layer_bytes(engines[0].model.layers[0]) // engines[0].model.dtype.itemsize
    cost = decode_cost_model(cfg.hidden_size, layer, overhead_seqs)
    plan = None if MODES[mode] is None else MemberLookahead(cost, min_tokens=1,
                                                            balanced=MODES[mode][0],
                                                            count=MODES[mode][1])
    members = _drop(engines, args.layers, plan)
    members[0].runner.overlap = MODES[mode] is None or not MODES[mode][2]
    busy: list[list[float]] = [[], []]
    for m, b in zip(members, busy, strict=True):
        m.stage.run = _timed(m.stage, b)
    tokens: dict = {}
    times: list[float] = []
    done = threading.Event()

    def member0():
        for k in range(args.steps + 2):
            t0 = time.perf_counter()
            for out in engines[0].step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if k >= 2:                   # two warm-up steps
                times.append(time.perf_counter() - t0)
            if k == 1:
                window.append(time.perf_counter())
                for b in busy:
                    b.clear()
        window.append(time.perf_counter())
        done.set()

    def member1():   # a little work all along: a new short request when one finishes
        n = 0
        while not done.is_set():
            if not engines[1].has_unfinished():
                n += 1
                engines[1].add_request(f"1-more{n}", [5 + n] * 32, _params(48))
            engines[1].step()

    window: list[float] = []
    _parallel([member0, member1])
    micro = members[0].runner.micro_batches
    for m in members:
        m.closing = True
    for m in members:
        m.close()
    wall = window[1] - window[0]
    return {"step_s": statistics.median(times), "layer_params": layer,
            "bubble": 1.0 - sum(sum(b) for b in busy) / (2 * wall),
            "micro_per_step": micro / (args.steps + 2), "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--long", type=int, default=3)
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--short", type=int, default=9)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)             # one core per member thread, as two devices
    cfg = ModelConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_layers=args.layers, num_heads=8, num_kv_heads=4,
                      max_position_embeddings=args.long_tokens + 256, seed=3)
    print(f"load average before: {os.getloadavg()}  (CPU, in process, loopback TCP)")
    print("repeat  mode                step_ms  vs_one  bubble  micro/step  tokens_equal")
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        res = {mode: run_mode(cfg, args, mode) for mode in ["one", "lookahead-g-serial"]}
        overhead = fitted_overhead(cfg, args, res["one"], res["lookahead-g-serial"])
        res |= {mode: run_mode(cfg, args, mode, overhead) for mode in MODES if mode not in res}
        for mode in MODES:
            x = res[mode]
            ratio = x["step_s"] / res["one"]["step_s"]
            ratios[mode].append(ratio)
            same = x["tokens"] == res["one"]["tokens"]
            print(f"{r:6d}  {mode:18s}  {x['step_s'] * 1e3:7.1f}  {ratio:6.2f}  "
                  f"{x['bubble']:6.1%}  {x['micro_per_step']:10.2f}  {same}")
        print(f"        fitted load per micro-batch: {overhead:.1f} sequences")
    print("median step time vs one: " + ", ".join(
        f"{m} {statistics.median(v):.2f}" for m, v in ratios.items()))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
