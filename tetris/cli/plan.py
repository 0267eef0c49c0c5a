"""``tetris plan``: the prefill plan one request would get, and the alternatives it beat.

    tetris plan --profile a100-llama3-8b-tp1 --pool 16 --node-size 8 \\
        --queue-times 0.31,0.31,0.31,0.31,0.31,0.31,0.31,0.31,0,0,0,0,0,0,0,0 \\
        --prompt-tokens 131072 --improvement-rate 0.3 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from tetris.config import SpLayoutConfig
from tetris.feature_config import PREFIX_PLACEMENTS
from tetris.scheduler.latency import ProfileError, load_profile
from tetris.scheduler.layout_policy import assign_layouts, landed_pool
from tetris.scheduler.policies import (
    DEFAULT_MIN_CHUNK_TOKENS,
    CdspPolicy,
    PolicyError,
    make_policy,
)
from tetris.scheduler.pool import PoolError, PoolState
from tetris.scheduler.prefix_move import PrefixMove
from tetris.scheduler.sp_comm import LLAMA3_8B, LayoutChooser


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show the prefill plan of one request on a given pool",
                       description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="a100-llama3-8b-tp1",
                   help="latency profile: embedded name or JSON path")
    p.add_argument("--pool", type=int, required=True, help="prefill instances in the SP pool")
    p.add_argument("--node-size", type=int, default=8, help="instances per node")
    p.add_argument("--queue-times", default="0",
                   help="comma-separated seconds until each instance is free (one value: all)")
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--improvement-rate", type=float, default=0.3, help="θ (default 0.3)")
    p.add_argument("--policy", default="tetris",
                   help="tetris, tetris-single-chunk, loongserve-disagg or fixed-sp-<k>")
    p.add_argument("--sp-candidates", default=None,
                   help="comma-separated SP sizes (default: every size of the profile)")
    p.add_argument("--min-chunk-tokens", type=int, default=DEFAULT_MIN_CHUNK_TOKENS)
    p.add_argument("--sp-layouts", default="ring",
                   help="layouts a chunk may use, e.g. ring,a2a (CSPS SP-NTP); default ring")
    p.add_argument("--sp-micro-partitions", default="1",
                   help="micro-partition counts a ring or a2a chunk may be pipelined over, "
                        "e.g. 1,2,4,8 (the cheapest per chunk); default 1: none")
    p.add_argument("--intra-node-gbps", type=float, default=SpLayoutConfig().intra_node_gbps)
    p.add_argument("--inter-node-gbps", type=float, default=SpLayoutConfig().inter_node_gbps)
    p.add_argument("--cached-tokens", type=int, default=0,
                   help="prefix caching: tokens of the prompt whose KV is cached")
    p.add_argument("--cached-on", default=None,
                   help="comma-separated instances holding the cached prefix, in ring order")
    p.add_argument("--cached-busy-s", type=float, default=None,
                   help="prefix caching: seconds until the holders are free (other work; "
                        "overrides their --queue-times)")
    p.add_argument("--cached-source-running", action="store_true",
                   help="prefix caching: the run that computed the prefix is still "
                        "prefilling (its KV cannot be moved yet)")
    p.add_argument("--placement", default="auto", choices=PREFIX_PLACEMENTS,
                   help="prefix caching: auto (the latency model's choice) or force extend, "
                        "move or recompute where possible")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _ints(text: str | None) -> list[int] | None:
    return None if text is None else [int(x) for x in text.split(",") if x.strip()]


def _queues(text: str, n: int) -> list[float]:
    vals = [float(x) for x in text.split(",") if x.strip()]
    if len(vals) == 1:
        return vals * n
    if len(vals) != n:
        raise ValueError(f"--queue-times has {len(vals)} values for a pool of {n}")
    return vals


def build(args: argparse.Namespace) -> dict:
    prof = load_profile(args.profile)
    pool = PoolState.uniform(args.pool, args.node_size, _holders_busy(args, _queues(
        args.queue_times, args.pool)))
    cands = _ints(args.sp_candidates)
    policy = make_policy(args.policy, prof, sp_candidates=cands,
                         min_chunk_tokens=args.min_chunk_tokens,
                         improvement_rate=args.improvement_rate)
    prefix = _prefix(args, policy, pool)
    plan = (prefix.plan if prefix is not None else
            policy.plan("cli", args.prompt_tokens, 0.0, pool, args.improvement_rate)
            ).validate(pool.size)
    plan = assign_layouts(plan, _chooser(args), landed_pool(pool, plan), 0.0,
                          prof).validate(pool.size)
    # Algorithm 2's view, whatever the policy: each single chunk, and the one θ would pick.
    single = CdspPolicy("tetris-single-chunk", prof, chunked=False, sp_candidates=cands,
                        improvement_rate=args.improvement_rate)
    search = single.search(args.prompt_tokens, 0.0, pool)
    pick = single.plan("cli", args.prompt_tokens, 0.0, pool)
    return {
        "policy": plan.policy, "profile": prof.name, "prompt_tokens": plan.prompt_tokens,
        "improvement_rate": plan.improvement_rate, "pool": pool.size, "node_size": args.node_size,
        "ttft_estimate": plan.ttft_estimate,
        "chunks": [{"start": c.start, "end": c.end, "tokens": c.tokens, "sp_size": c.sp_size,
                    "instances": list(c.instances), "expected_start": c.expected_start,
                    "expected_end": c.expected_end, "sp_layout": c.sp_layout,
                    "sp_layout_reason": c.sp_layout_reason,
                    "sp_micro_partitions": c.sp_micro_partitions} for c in plan.chunks],
        "single_chunk_options": [{"sp_size": s, "instances": list(m), "expected_start": st,
                                  "ttft": t} for s, m, st, t in search.options(args.prompt_tokens)],  # now = 0
        "single_chunk_choice": {"sp_size": pick.chunks[0].sp_size, "ttft": pick.ttft_estimate},
        **({} if prefix is None else {"prefix": {
            "hit_tokens": args.cached_tokens, "holders": _ints(args.cached_on),
            "decision": prefix.decision, "cached_tokens": plan.cached_tokens,
            "other_option_ttft": prefix.other_ttft, "placement": args.placement,
            "ttfts": prefix.ttfts, "unavailable": prefix.unavailable, "reason": prefix.reason,
            "moved": plan.cached_moved, "move_s": prefix.move_s,
            "move_bytes": prefix.move_bytes}}),
    }


def _prefix(args: argparse.Namespace, policy, pool: PoolState):
    """The plan from a cached prefix (``extend`` or ``recompute``, the latency model's pick),
    or None without ``--cached-tokens``."""
    if args.cached_tokens <= 0:
        return None
    holders = _ints(args.cached_on)
    if not holders:
        raise ValueError("--cached-tokens needs --cached-on (the instances holding the prefix)")
    from tetris.scheduler.prefix_plan import plan_from_prefix

    return plan_from_prefix(policy, "cli", args.prompt_tokens, 0.0, pool,
                            cached_tokens=args.cached_tokens, holders=holders, source="cli",
                            improvement_rate=args.improvement_rate, placement=args.placement,
                            source_ready=not args.cached_source_running,
                            move=PrefixMove.from_chooser(_chooser(args)))


def _holders_busy(args: argparse.Namespace, queue: list[float]) -> list[float]:
    """``--cached-busy-s`` as the holders' queue times."""
    holders = _ints(args.cached_on) or []
    if args.cached_busy_s is None or args.cached_tokens <= 0:
        return queue
    if any(not 0 <= i < len(queue) for i in holders):
        raise ValueError(f"--cached-on names an instance outside the pool of {len(queue)}")
    return [args.cached_busy_s if i in holders else q for i, q in enumerate(queue)]


def _chooser(args: argparse.Namespace) -> LayoutChooser:
    """Layouts by CSPS Appendix A costs on the profile's model (the shipped profiles are
    LLaMA3 on A100; the 70B one at TP 4 has 8 KV heads / 4 = 2 per instance)."""
    cfg = SpLayoutConfig(layouts=tuple(x.strip() for x in args.sp_layouts.split(",")),
                         intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                         micro_partitions=tuple(_ints(args.sp_micro_partitions)))
    return LayoutChooser.from_config(cfg, LLAMA3_8B)


def _print_table(out: dict) -> None:
    print(f"{out['policy']}: {out['prompt_tokens']} tokens on a pool of {out['pool']} "
          f"(nodes of {out['node_size']}), θ = {out['improvement_rate']}, profile {out['profile']}")
    print(f"{'chunk':>5} {'tokens':>8} {'range':>17} {'SP':>3} {'start s':>8} {'end s':>8}  instances")
    for k, c in enumerate(out["chunks"]):
        rng = f"[{c['start']}, {c['end']})"
        print(f"{k:>5} {c['tokens']:>8} {rng:>17} {c['sp_size']:>3} {c['expected_start']:>8.3f} "
              f"{c['expected_end']:>8.3f}  {','.join(map(str, c['instances']))}")
        if c["sp_layout_reason"]:
            pieces = f"/{c['sp_micro_partitions']}" if c["sp_micro_partitions"] > 1 else ""
            print(f"      layout {c['sp_layout']}{pieces}: {c['sp_layout_reason']}")
    print(f"TTFT estimate {out['ttft_estimate']:.3f} s")
    if "prefix" in out:
        _print_prefix(out["prefix"])
    print("single-chunk alternatives (Algorithm 2):")
    for o in out["single_chunk_options"]:
        mark = " <- θ pick" if o["sp_size"] == out["single_chunk_choice"]["sp_size"] else ""
        print(f"  SP {o['sp_size']:>3}: start {o['expected_start']:.3f} s, TTFT {o['ttft']:.3f} s{mark}")


def _print_prefix(pf: dict) -> None:
    """The decision line, then every option's TTFT (or why it was not offered)."""
    print(f"prefix cache: {pf['hit_tokens']} tokens cached on "
          f"{','.join(map(str, pf['holders']))}: {pf['decision']} (placement "
          f"{pf['placement']}; history {pf['cached_tokens']} tokens)"
          + (f"; {pf['reason']}" if pf["reason"] else ""))
    for x, t in pf["ttfts"].items():
        if x in pf["unavailable"]:
            print(f"  {x}: {pf['unavailable'][x]}")
            continue
        extra = (f" (move {pf['move_bytes'] / 1e9:.3f} GB in {pf['move_s'] * 1e3:.3f} ms)"
                 if x == "move" else "")
        mark = " <- chosen" if x == pf["decision"] else ""
        print(f"  {x}: TTFT {t:.3f} s{extra}{mark}")


def run(args: argparse.Namespace) -> int:
    try:
        out = build(args)
    except (ProfileError, PolicyError, PoolError, ValueError) as e:
        print(f"tetris plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        _print_table(out)
    return 0
