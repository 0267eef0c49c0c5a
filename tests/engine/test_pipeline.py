"""KunServe cooperative execution in process: drop into a pipeline, exchange KV, restore.

Tokens must equal the single engine's, greedy and seeded-sampled, for a batch of mixed
lengths, with nothing recomputed across the drop and the restore. The tiny random model's next
token depends mostly on the current one, so tokens alone barely see the KV: every token's
logprob and top alternatives (read off the logits) must be bit-identical too. Queries are
scaled up so that attention is not near uniform and a wrong key shows, not only a wrong
value.
"""

import msgspec
import pytest

from tests.engine.engine_helpers import TINY
from tetris.control.kunserve_memory import InstanceMemory
from tetris.engine.engine import LLMEngine
from tetris.engine.pipeline import layer_bytes
from tetris.engine.pipeline_group import drop, layer_block_bytes
from tetris.model.loader import load_model
from tetris.sampling_params import SamplingParams

CFG = msgspec.structs.replace(TINY, num_layers=6)
BLOCKS = 40
SHARPEN = 40.0
PROMPTS = [[5, 9, 13], list(range(20, 57)), [7] * 11, list(range(100, 119)), [3, 1]]
MAX_TOKENS = [14, 10, 16, 8, 12]
_REFERENCE: dict = {}


def _model():
    """The seeded model with queries scaled up: its attention is then far from uniform, so a
    wrong key (not only a wrong value) changes the logits."""
    model, _ = load_model(CFG)          # every member its own copy (same seed, same weights)
    for layer in model.layers:
        layer.self_attn.q_proj.weight.mul_(SHARPEN)   # a view into the fused qkv weight
    return model


def _engine():
    return LLMEngine(_model(), num_blocks=BLOCKS, block_size=4, max_num_seqs=8)


def _params(sampled: bool):
    return [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2,
                           **({"temperature": 0.9, "top_p": 0.95, "seed": 11 + i}
                              if sampled else {"temperature": 0.0}))
            for i, n in enumerate(MAX_TOKENS)]


def _assert_same(got, expected, tol=0.0):
    assert sorted(got) == sorted(expected)
    for rid, ref in expected.items():
        out = got[rid]
        assert [t for t, _, _ in out] == [t for t, _, _ in ref], rid
        for (_, lp, top), (_, lp_ref, top_ref) in zip(out, ref, strict=True):
            assert abs(lp - lp_ref) <= tol, rid
            assert [i for i, _ in top] == [i for i, _ in top_ref], rid
            assert max(abs(a - b) for (_, a), (_, b) in zip(top, top_ref, strict=True)) <= tol


def _collect(outputs, tokens):
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(
            (t, lp.logprob, lp.top) for t, lp in zip(out.new_token_ids, out.new_logprobs,
                                                      strict=True))


def _run(engines, tokens, steps=None):
    n = 0
    while any(e.has_unfinished() for e in engines) and (steps is None or n < steps):
        for e in engines:
            _collect(e.step(), tokens)
        n += 1


def _reference(params, late):
    key = params[0].temperature
    if key not in _REFERENCE:          # one single-engine run per sampling mode
        _REFERENCE[key] = _single_engine(params, late)
    return _REFERENCE[key]


def _single_engine(params, late):
    ref = _engine()
    tokens = {}
    for i, p in enumerate(PROMPTS):
        ref.add_request(f"r{i}", p, params[i])
    _run([ref], tokens, steps=5)
    ref.add_request("late", late[0], late[1])
    _run([ref], tokens)
    return tokens


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("ranges", [[(0, 3), (3, 6)], [(0, 1), (1, 4), (4, 6)]],
                         ids=["2-stage", "3-stage"])
def test_drop_and_restore_mid_generation_keep_the_single_engines_tokens(ranges, sampled):
    params = _params(sampled)
    late = (list(range(60, 75)), params[0])
    expected = _reference(params, late)
    engines = [_engine() for _ in ranges]
    home, tokens = engines[0], {}
    for i, p in enumerate(PROMPTS):
        home.add_request(f"r{i}", p, params[i])
    _run([home], tokens, steps=3)
    group = drop(engines, ranges)
    assert group.exchange_bytes > 0
    _run([home], tokens, steps=2)        # pipelined decodes only: nothing recomputed
    assert group.runner.prefill_tokens == 0 and group.runner.steps == 2
    home.add_request("late", late[0], late[1])   # admitted and prefilled by the pipeline
    _run([home], tokens, steps=3)
    runner = group.runner
    assert runner.prefill_tokens == len(late[0])
    assert runner.activation_hops == runner.steps * (len(ranges) - 1)
    group.restore()
    assert all(e.model.layers[i].self_attn is not None for e in engines for i in range(6))
    _run(engines, tokens)
    _assert_same(tokens, expected)


def test_requests_of_every_member_merge_and_go_home():
    params = _params(False)
    ref = [_engine(), _engine()]
    expected = {}
    for i, p in enumerate(PROMPTS):
        ref[i % 2].add_request(f"r{i}", p, params[i])
    _run(ref, expected)
    engines, tokens = [_engine(), _engine()], {}
    for i, p in enumerate(PROMPTS):
        engines[i % 2].add_request(f"r{i}", p, params[i])
    _run(engines, tokens, steps=3)
    group = drop(engines, [(0, 2), (2, 6)])
    assert not engines[1].has_unfinished() and len(engines[0].batcher.running) == 5
    _run([engines[0]], tokens, steps=3)
    assert group.runner.prefill_tokens == 0
    group.restore()
    assert sorted(engines[1]._seqs) == ["r1", "r3"]
    _run(engines, tokens)
    _assert_same(tokens, expected)


def test_group_capacity_is_invariant_2_on_the_real_tensors():
    engines = [_engine() for _ in range(3)]
    m = engines[0].model
    per_layer = layer_bytes(m.layers[0])
    lbb = layer_block_bytes(engines[0])
    mem = InstanceMemory(num_layers=6, layer_param_bytes=per_layer, other_param_bytes=1,
                         kv_bytes=BLOCKS * 6 * lbb, layer_block_bytes=lbb, block_size=4)
    group = drop(engines, [(0, 2), (2, 4), (4, 6)])
    assert group.group_blocks == mem.group_kv_blocks([2, 2, 2])
    assert group.freed_param_bytes == 2 * 6 * per_layer     # (g - 1) copies of the layers
    assert engines[0].stats().total_blocks == group.group_blocks
    held = sum(p.numel() * p.element_size() for e in engines for p in e.model.layers.parameters())
    assert held == 6 * per_layer                              # one copy left in the group
    assert group.group_blocks == (3 * BLOCKS * 6 * lbb + 2 * 6 * per_layer) // (6 * lbb)


def test_a_drop_that_loses_a_layer_is_refused_and_changes_nothing():
    engines = [_engine(), _engine()]
    engines[0].add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    engines[0].step()
    before = [(e.runner, e.blocks, e.cache, len(list(e.model.layers.parameters())))
              for e in engines]
    for ranges in ([(0, 2), (3, 6)], [(0, 4), (2, 6)], [(0, 3), (3, 5)]):
        with pytest.raises(ValueError, match="last copy|without a copy"):
            drop(engines, ranges)
        assert [(e.runner, e.blocks, e.cache, len(list(e.model.layers.parameters())))
                for e in engines] == before
    group = drop(engines, [(0, 3), (3, 6)])
    with pytest.raises(ValueError, match="undropped engine"):      # a member again
        drop([engines[1], _engine()], [(0, 3), (3, 6)])
    assert engines[1].cache is None and group.runner is engines[0].runner


def _run_tokens(engines, tokens, steps=None):
    """``_run`` keeping each request's cumulative token ids (no logprobs asked)."""
    n = 0
    while any(e.has_unfinished() for e in engines) and (steps is None or n < steps):
        for e in engines:
            for out in e.step():
                tokens[out.request_id] = list(out.token_ids)
        n += 1


@pytest.mark.parametrize("dead", [0, 1])
def test_a_member_lost_mid_pipeline_resumes_its_requests_on_rebuilt_survivors(dead):
    import torch
    from tetris.actors.prefill.executor import sample_first_token
    from tetris.kernels.paged_decode import write_kv

    from tests.engine.test_engine import _prefill_kv
    from tetris.engine.pipeline_group import lose_member

    params = [msgspec.structs.replace(p, logprobs=None) for p in _params(True)]
    ref, expected = _engine(), {}
    for i, p in enumerate(PROMPTS):
        ref.add_request(f"r{i}", p, params[i])
    _run_tokens([ref], expected)
    engines, tokens = [_engine() for _ in range(3)], {}
    for i, p in enumerate(PROMPTS):
        engines[0].add_request(f"r{i}", p, params[i])
    _run_tokens([engines[0]], tokens, steps=3)
    group = drop(engines, [(0, 2), (2, 4), (4, 6)])
    _run_tokens([engines[0]], tokens, steps=3)
    host = _model()                            # the host/checkpoint copy of the weights
    survivors, resumes = lose_member(group, dead, lambda i: host.layers[i].state_dict())
    assert len(survivors) == 2 and engines[dead] not in survivors
    unfinished = [f"r{i}" for i, n in enumerate(MAX_TOKENS) if len(tokens[f"r{i}"]) < n]
    assert sorted(r.request_id for r in resumes) == unfinished
    home = survivors[0]
    for r in resumes:                          # the resume path: prefill elsewhere, reserve
        assert list(r.generated) == tokens[r.request_id]
        full = list(r.prompt_token_ids) + list(r.generated)
        slots = torch.tensor(home.reserve(r.request_id, r.prompt_token_ids, r.params,
                                          r.generated))
        kv, _, logits = _prefill_kv(host, full)
        for i, (k, v) in enumerate(kv):
            write_kv(home.cache.k[i], home.cache.v[i], k, v, slots)
        home.commit_prefilled(r.request_id, sample_first_token(logits, r.params, len(full)))
    _run_tokens(survivors, tokens)
    assert tokens == expected


def test_a_prefilled_request_streams_each_layer_to_its_member_and_decodes_in_the_pipeline():
    import torch
    from tetris.kernels.paged_decode import write_kv

    from tests.engine.test_engine import _prefill_kv

    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0, logprobs=2)
    prompt = list(range(30, 51))
    host = _model()
    kv, first, logits = _prefill_kv(host, prompt)
    first_lp = _first_logprob(logits, first)

    def serve(engine, write):
        slots = torch.tensor(engine.reserve("p", prompt, params))
        for layer, (k, v) in enumerate(kv):
            write(layer, k, v, slots)
        engine.commit_prefilled("p", first, first_lp)
        tokens = {}
        _run([engine], tokens)
        return tokens["p"]

    single = _engine()
    expected = serve(single, lambda i, k, v, s: write_kv(single.cache.k[i], single.cache.v[i],
                                                         k, v, s))
    engines = [_engine() for _ in range(3)]
    group = drop(engines, [(0, 2), (2, 5), (5, 6)])
    # layer l reaches only the cache of the member that runs it
    got = serve(engines[0], lambda i, k, v, s: write_kv(*group.layer_cache(i), k, v, s))
    _assert_same({"p": got}, {"p": expected})
    assert len(got) == 10
    assert group.runner.prefill_tokens == 0


def _first_logprob(logits, token):
    """The first token's logprob as a prefill reports it (same for both engines compared)."""
    import torch

    from tetris.engine.request import TokenLogprob

    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(2)
    return TokenLogprob(token, float(lp[token]),
                        tuple((int(i), float(v)) for v, i in zip(top.values, top.indices,
                                                                 strict=True)))
