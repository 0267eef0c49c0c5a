"""LLMEngine on the seeded tiny model: paged, batched, chunked and preempted execution all
give the tokens of a cache-free recompute; requests join, abort and fail cleanly."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tetris.engine.engine import LLMEngine
from tetris.kernels.paged_decode import write_kv
from tetris.sampling_params import SamplingParams

from engine_helpers import TINY, greedy_reference, prefill_kv, reference_logprobs
from exactness import TOP, assert_same_run
from engine_helpers import tiny_model as _load_tiny



@pytest.fixture(scope="module")
def tiny_model():
    return _load_tiny()


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model):
    model, _ = tiny_model
    prompts = _prompts([5, 17, 33, 2])
    return prompts, [greedy_reference(model, p, GREEDY.max_tokens) for p in prompts]


def test_batch_of_mixed_lengths_matches_cache_free_recompute(tiny_model, reference):
    model, tok = tiny_model
    prompts, expected = reference
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    outs = engine.generate(prompts, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    assert engine.num_free_blocks == 64 and not engine.has_unfinished()


def test_chunked_prefill_and_preemption_keep_the_tokens(tiny_model, reference):
    model, tok = tiny_model
    prompts, expected = reference
    # An 8-token budget chunks every long prompt; 16 blocks of 4 cannot hold all four
    # sequences (at most 45 tokens each), so decodes preempt and recompute the newest.
    engine = LLMEngine(model, tok, num_blocks=16, block_size=4, max_num_batched_tokens=8)
    preempted = []
    outs = {f"r{i}": ([], []) for i in range(4)}
    params = msgspec.structs.replace(GREEDY, logprobs=TOP)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        plan_seqs = list(engine.batcher.running)
        for out in engine.step():
            outs[out.request_id][0].extend(out.new_token_ids)
            outs[out.request_id][1].extend(out.new_logprobs)
        preempted += [s for s in plan_seqs if s.num_preemptions]
    assert preempted, "the cache was meant to be too small for all four at once"
    # tokens, and logprobs: a chunk that missed part of its history can keep greedy tokens
    for i, (p, want) in enumerate(zip(prompts, expected, strict=True)):
        assert_same_run(*outs[f"r{i}"], (want, reference_logprobs(model, p, want, TOP)), f"r{i}")
    assert engine.num_free_blocks == 16


def test_new_request_joins_running_decodes_at_next_step(tiny_model, reference):
    model, tok = tiny_model
    prompts, expected = reference
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    engine.add_request("a", prompts[0], GREEDY)
    first = engine.step()
    assert [o.request_id for o in first] == ["a"]
    engine.add_request("b", prompts[1], GREEDY)
    second = engine.step()
    assert sorted(o.request_id for o in second) == ["a", "b"]
    got = {"a": [first[0].new_token_ids[0]], "b": []}
    for o in second:
        got[o.request_id] += list(o.new_token_ids)
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += list(o.new_token_ids)
    assert got == {"a": expected[0], "b": expected[1]}


def test_abort_frees_blocks_and_reports_abort(tiny_model):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, num_blocks=32, block_size=4)
    engine.add_request("a", _prompts([9])[0], GREEDY)
    engine.add_request("b", _prompts([3])[0], GREEDY)
    engine.step()
    assert engine.num_free_blocks < 32
    assert engine.abort_request("a") and not engine.abort_request("nope")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    engine.abort_request("b")
    engine.step()
    assert engine.num_free_blocks == 32 and not engine.has_unfinished()


def test_seeded_sampling_is_independent_of_batch(tiny_model):
    model, tok = tiny_model
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    prompt = _prompts([6])[0]
    alone = LLMEngine(model, tok, num_blocks=64, block_size=4).generate([prompt], params)[0]
    others = [msgspec.structs.replace(params, seed=s) for s in (1, 2)]
    batch = LLMEngine(model, tok, num_blocks=64, block_size=4).generate(
        [_prompts([4])[0], prompt, _prompts([11])[0]], [others[0], params, others[1]])
    assert batch[1].token_ids == alone.token_ids
    assert batch[0].token_ids != batch[2].token_ids


def test_stop_string_and_stop_token(tiny_model, reference):
    model, tok = tiny_model
    prompts, expected = reference
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    stop_tok = expected[1][3]
    params = msgspec.structs.replace(GREEDY, stop_token_ids=(stop_tok,))
    out = engine.generate([prompts[1]], params)[0]
    cut = expected[1].index(stop_tok) + 1
    assert list(out.token_ids) == expected[1][:cut] and out.finish_reason == "stop"
    letters = _Letters()
    engine = LLMEngine(model, letters, num_blocks=64, block_size=4)
    full = letters.decode(expected[0])
    stop = full[5:7]
    out = engine.generate([prompts[0]], msgspec.structs.replace(GREEDY, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
    assert len(out.token_ids) < len(expected[0])


class _Letters:
    """A tokenizer whose every token is one letter, so any generated text can be stopped on."""

    eos_token_ids = ()

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_eos_stops_unless_ignored(tiny_model, reference):
    model, tok = tiny_model
    prompts, expected = reference
    eos = expected[2][4]
    engine = LLMEngine(model, None, num_blocks=64, block_size=4)
    engine._eos = frozenset([eos])  # pretend the 5th greedy token is this model's EOS
    out = engine.generate([prompts[2]], msgspec.structs.replace(GREEDY, ignore_eos=False))[0]
    assert list(out.token_ids) == expected[2][:expected[2].index(eos) + 1]
    out = engine.generate([prompts[2]], GREEDY)[0]
    assert list(out.token_ids) == expected[2]


def test_bad_input_raises_value_error_with_numbers(tiny_model):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, num_blocks=128, block_size=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], GREEDY)
    too_long = [1] * (TINY.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="257 tokens but the model's context is 256"):
        engine.add_request("l", too_long, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("v", [1, 320], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("p", [1], {"temperature": 0})
    small = LLMEngine(model, tok, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV cache holds only 8 tokens"):
        small.add_request("c", [1] * 8, GREEDY)
    engine.add_request("dup", [1], GREEDY)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", [1], GREEDY)
    assert not small.has_unfinished()


def test_generation_stops_at_the_context_limit(tiny_model):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, num_blocks=128, block_size=4)
    prompt = [1] * (TINY.max_position_embeddings - 3)
    out = engine.generate([prompt], SamplingParams(max_tokens=50, temperature=0.0,
                                                   ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def _prefill_kv(model, prompt):
    """The prompt's per-layer K/V and greedy first token, computed outside any engine."""
    kv, row = prefill_kv(model, prompt)
    return kv, int(row[0].argmax(-1)), row[0]


def test_prefilled_request_joins_and_continues_like_a_local_one(tiny_model, reference):
    model, tok = tiny_model
    prompts, expected = reference
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    engine.add_request("local", prompts[0], GREEDY)
    got = {"local": [], "remote": []}
    for out in engine.step():
        got[out.request_id] += out.new_token_ids
    assert engine.can_reserve(len(prompts[3]))
    slots = engine.reserve("remote", prompts[3], GREEDY)
    assert len(slots) == len(prompts[3])
    kv, first, _ = _prefill_kv(model, prompts[3])
    slot_tensor = torch.tensor(slots)
    for i, (k, v) in enumerate(kv):
        write_kv(engine.cache.k[i], engine.cache.v[i], k, v, slot_tensor)
    engine.commit_prefilled("remote", first)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got == {"local": expected[0], "remote": expected[3]}
    assert engine.num_free_blocks == 64


def _resume(engine, model, rid, prompt, params, generated):
    """Reserve ``prompt`` with ``generated`` already out, write their KV, commit the next token;
    the outputs until finished."""
    from tetris.actors.prefill.executor import sample_first_token

    slots = engine.reserve(rid, prompt, params, generated)
    assert len(slots) == len(prompt) + len(generated)
    kv, _, logits = _prefill_kv(model, list(prompt) + list(generated))
    # sampled as a prefill worker samples the first token of the prompt it is given
    first = sample_first_token(logits, params, len(prompt) + len(generated))
    for i, (k, v) in enumerate(kv):
        write_kv(engine.cache.k[i], engine.cache.v[i], k, v, torch.tensor(slots))
    engine.commit_prefilled(rid, first)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_a_resumed_request_goes_on_from_the_tokens_already_streamed(tiny_model, reference):
    model, tok = tiny_model
    prompts, expected = reference
    prompt, ref = prompts[1], expected[1]
    full = LLMEngine(model, tok, num_blocks=64, block_size=4).generate([prompt], GREEDY)[0]
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    outs = _resume(engine, model, "r", prompt, GREEDY, ref[:5])
    # the first output carries the 5 resumed tokens and the new one, and the whole text
    assert outs[0].token_ids == tuple(ref[:6]) and outs[0].new_token_ids == (ref[5],)
    assert list(outs[-1].token_ids) == ref and outs[-1].finish_reason == "length"
    assert outs[-1].text == full.text and "".join(o.new_text for o in outs) == full.text
    assert engine.num_free_blocks == 64

    # a stop string across the resume point is found as in the run that lost nothing
    stop = full.text[3:7]
    params = msgspec.structs.replace(GREEDY, stop=(stop,))
    cut = LLMEngine(model, tok, num_blocks=64, block_size=4).generate([prompt], params)[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    n_before = next(n for n in range(1, 12) if len(tok.decode(ref[:n])) >= 5)
    again = _resume(engine, model, "s", prompt, params, ref[:n_before])
    assert (again[-1].text, again[-1].finish_reason) == (cut.text, "stop")
    assert again[-1].token_ids == cut.token_ids


def test_a_seeded_sampled_request_is_the_same_local_prefilled_elsewhere_and_resumed(tiny_model):
    model, tok = tiny_model
    prompt = _prompts([21], seed=3)[0]
    params = SamplingParams(max_tokens=16, temperature=1.5, top_k=50, seed=11, ignore_eos=True)
    local = LLMEngine(model, tok, num_blocks=64, block_size=4).generate([prompt], params)[0]
    ref = list(local.token_ids)
    assert len(set(ref)) > 4                                # sampled, not one repeated token
    engine = LLMEngine(model, tok, num_blocks=64, block_size=4)
    for k in (0, 1, 9):   # prefilled elsewhere; resumed after 1 and after 9 streamed tokens
        outs = _resume(engine, model, f"k{k}", prompt, params, ref[:k])
        assert list(outs[-1].token_ids) == ref and outs[-1].text == local.text
    other = msgspec.structs.replace(params, seed=12)
    assert list(LLMEngine(model, tok, num_blocks=64, block_size=4)
                .generate([prompt], other)[0].token_ids) != ref


def test_resumed_tokens_that_already_end_the_request_are_refused(tiny_model):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, num_blocks=16, block_size=4)
    short = msgspec.structs.replace(GREEDY, max_tokens=3)
    with pytest.raises(ValueError, match="already ends the request at its token 3 of 3"):
        engine.reserve("a", [1, 2, 3], short, [4, 5, 6])
    with pytest.raises(ValueError, match="already ends the request at its token 2"):
        engine.reserve("b", [1, 2, 3], msgspec.structs.replace(GREEDY, stop_token_ids=(9,)),
                       [4, 9, 5])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.reserve("c", [1, 2, 3], GREEDY, [4, 10_000])
    assert engine.num_free_blocks == 16 and not engine.has_unfinished()


def test_reserved_request_can_be_aborted_and_rejects_bad_commits(tiny_model):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, num_blocks=8, block_size=4)
    assert not engine.can_reserve(40)
    with pytest.raises(ValueError, match="is not reserved"):
        engine.commit_prefilled("x", 1)
    engine.reserve("x", [1, 2, 3, 4, 5], GREEDY)
    assert engine.num_free_blocks == 6
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.commit_prefilled("x", 10_000)
    assert engine.abort_request("x")
    assert engine.num_free_blocks == 8
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    # A first token that is a stop token finishes at once, holding nothing.
    engine.reserve("y", [1, 2, 3], msgspec.structs.replace(GREEDY, stop_token_ids=(7,)))
    engine.commit_prefilled("y", 7)
    outs = engine.step()
    assert [(o.token_ids, o.finish_reason) for o in outs] == [((7,), "stop")]
    assert engine.num_free_blocks == 8 and not engine.has_unfinished()


def test_stats_count_queues_and_blocks(tiny_model):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, num_blocks=16, block_size=4, max_num_seqs=1)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [1, 2], GREEDY)
    engine.reserve("c", [5, 6, 7, 8, 9], GREEDY)
    engine.step()
    st = engine.stats()
    assert (st.running, st.waiting, st.ready, st.receiving) == (1, 1, 0, 1)
    assert st.free_blocks == 16 - 1 - 2 and st.total_blocks == 16 and st.block_size == 4
