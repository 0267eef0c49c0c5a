"""Served KunServe members in process: two engines, each a ``GroupMember`` joined by real
socket links (no Ray). A drop and a restore in the middle of generation give every token and
logprob of the single engine, with nothing recomputed; the capacity grows by exactly the
freed parameter bytes over the block bytes (KunServe invariant 2)."""

import threading

import msgspec
import pytest
from tetris.actors.decode.pipeline_stage import GroupMember, member_blocks

from tests.engine.engine_helpers import TINY
from tetris.engine.engine import LLMEngine
from tetris.engine.kv_cache import kv_bytes_per_block
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

CFG = msgspec.structs.replace(TINY, num_layers=4)
BLOCKS = 24
SHARPEN = 40.0
PROMPTS = [[5, 9, 13], list(range(20, 47)), [7] * 11, list(range(100, 119))]
MAX_TOKENS = [14, 10, 16, 12]


def _engine():
    model, _ = load_model(CFG)
    for layer in model.layers:   # attention far from uniform: a wrong key changes logits
        layer.self_attn.q_proj.weight.mul_(SHARPEN)
    return LLMEngine(model, num_blocks=BLOCKS, block_size=4, max_num_seqs=8)


def _params():
    return [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2, temperature=0.0)
            for n in MAX_TOKENS]


def _collect(outputs, tokens):
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(
            (t, lp.logprob) for t, lp in zip(out.new_token_ids, out.new_logprobs, strict=True))


def _step_all(engines, tokens, steps=None):
    n = 0
    while any(e.has_unfinished() for e in engines) and (steps is None or n < steps):
        for e in engines:
            _collect(e.step(), tokens)
        n += 1


def _in_threads(fns):
    """Run each member's half at once (they exchange with each other); re-raise errors."""
    out, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _members(engines):
    members = [GroupMember(e, j, "127.0.0.1") for j, e in enumerate(engines)]
    addrs = [m.address for m in members]
    _in_threads([lambda m=m: m.connect(addrs, 10.0) for m in members])
    return members


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]],
                         ids=["group-of-2", "group-of-3"])
def test_drop_and_restore_mid_generation_equal_the_single_engine(ranges):
    single = _engine()
    expected: dict = {}
    for i, (p, sp) in enumerate(zip(PROMPTS, _params(), strict=True)):
        single.add_request(f"r{i}", p, sp)
    _step_all([single], expected)

    n = len(ranges)
    engines = [_engine() for _ in range(n)]
    for i, (p, sp) in enumerate(zip(PROMPTS, _params(), strict=True)):
        engines[i % n].add_request(f"r{i}", p, sp)
    got: dict = {}
    _step_all(engines, got, steps=4)
    base = [e.stats().total_blocks for e in engines]
    g = min(member_blocks(e, *r) for e, r in zip(engines, ranges, strict=True))
    parts = [(j * g // n, (j + 1) * g // n) for j in range(n)]
    members = _members(engines)
    try:
        freed = _in_threads([lambda m=m: m.drop(ranges, g, parts) for m in members])
        block_bytes = kv_bytes_per_block(CFG.num_layers, 4, CFG.num_kv_heads,
                                         CFG.hidden_size // CFG.num_heads,
                                         engines[0].model.dtype)
        # invariant 2: each member's blocks = (KV bytes + freed bytes) // its layers' block
        # bytes; the group's are the smallest member's; for an even split that is the old
        # blocks plus the freed bytes over whole-model block bytes
        layer_block = block_bytes // CFG.num_layers
        per_member = [(BLOCKS * block_bytes + f) // ((t - s) * layer_block)
                      for f, (s, t) in zip(freed, ranges, strict=True)]
        assert g == min(per_member)
        if n == 2:
            assert g == sum(base) + sum(freed) // block_bytes
        assert sum(e.stats().total_blocks for e in engines) == g > sum(base)
        _step_all(engines, got, steps=5)
        assert all(m.runner.prefill_tokens == 0 for m in members)   # nothing recomputed
        assert all(m.stage_runs >= 5 for m in members)     # each served the other's steps
        _in_threads([lambda m=m: m.restore(BLOCKS) for m in members])
    finally:
        for m in members:
            m.close()
    assert [e.stats().total_blocks for e in engines] == base
    _step_all(engines, got)
    assert sorted(got) == sorted(expected)
    for rid, ref in expected.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in ref], rid
        assert max(abs(a - b) for (_, a), (_, b) in zip(got[rid], ref, strict=True)) == 0.0, rid


def test_a_member_that_cannot_hold_its_requests_refuses_before_changing_anything():
    engines = [_engine(), _engine()]
    for i, p in enumerate(PROMPTS):
        engines[0].add_request(f"r{i}", p, _params()[i])
    _step_all(engines, {}, steps=2)
    members = _members(engines)
    try:
        with pytest.raises(ValueError, match="more than its 1 blocks"):
            members[0].drop([(0, 2), (2, 4)], 40, [(0, 1), (1, 40)])
        assert engines[0].cache is not None and len(engines[0].model.layers[3].state_dict())
    finally:
        for m in members:
            m.close()
