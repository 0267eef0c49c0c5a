"""``Sequence.tokens``: the prompt kept as one int32 buffer, read like a list."""

from __future__ import annotations

from array import array

import pytest

from tetris.engine.request import Sequence, Tokens
from tetris.sampling_params import SamplingParams
from tetris.token_ids import compact_tokens


def _seq(prompt) -> Sequence:
    return Sequence("r", prompt, SamplingParams(max_tokens=4), seed=None,
                    stop_token_ids=frozenset(), max_total_tokens=1 << 20)


def test_tokens_read_like_the_list_they_replace():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    seq = _seq(prompt)
    for t in (7, 8, 100_000):
        seq.tokens.append(t)
    ref = prompt + [7, 8, 100_000]
    assert len(seq.tokens) == len(ref) == seq.num_tokens
    assert seq.tokens == ref and list(seq.tokens) == ref
    for i in range(-len(ref), len(ref)):
        assert seq.tokens[i] == ref[i]
    for a in range(len(ref) + 1):          # every slice: inside the prompt, across, generated
        for b in range(a, len(ref) + 2):
            got = seq.tokens[a:b]
            assert got == ref[a:b] and type(got) is list and all(type(x) is int for x in got)
    assert seq.tokens[::3] == ref[::3] and seq.tokens[-3:] == ref[-3:]
    with pytest.raises(IndexError):
        seq.tokens[len(ref)]
    assert seq.output_token_ids == [7, 8, 100_000] and seq.num_prompt_tokens == len(prompt)


def test_the_prompt_costs_four_bytes_a_token_and_an_int32_buffer_is_not_copied():
    ids = array("i", range(100_000, 200_000))
    seq = _seq(ids)
    assert seq.prompt_token_ids is ids                       # the caller's buffer, as is
    assert seq.prompt_token_ids.itemsize * len(ids) == 400_000
    assert compact_tokens([1, 2, 3]) == array("i", [1, 2, 3])
    with pytest.raises(ValueError, match="int32"):
        compact_tokens([1, 2 ** 40])


def test_equality_with_other_token_sequences():
    a, b = Tokens(array("i", [1, 2])), Tokens(array("i", [1, 2]))
    a.append(3)
    assert a != b
    b.append(3)
    assert a == b and a == (1, 2, 3) and a != [1, 2] and a != 5


def test_engine_refuses_ids_past_the_vocabulary_or_int32():
    from tetris.config import load_deployment
    from tetris.engine.engine import LLMEngine

    engine = LLMEngine.from_deployment(load_deployment(None))   # the tiny seeded model
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("big", [1, 2 ** 40], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("neg", [1, -1], SamplingParams(max_tokens=1))


def test_output_deltas_merge_and_add_up_to_the_engine_output():
    from tetris.engine.request import OutputDelta, RequestOutput, Transcript

    outs = [RequestOutput("r", (), (5,), (5,), "a", "a", False),
            RequestOutput("r", (), (5, 6), (6,), "a", "", False),      # text held back
            RequestOutput("r", (), (5, 6, 7), (7,), "abc", "bc", True, "stop")]
    deltas = [OutputDelta.of(o) for o in outs]
    assert [d.num_tokens for d in deltas] == [1, 2, 3]
    whole = Transcript()
    for d in deltas:
        whole.add(d)
    assert (whole.token_ids, whole.text, whole.finished, whole.finish_reason) == (
        [5, 6, 7], "abc", True, "stop")
    merged = deltas[0].merged(deltas[1]).merged(deltas[2])
    assert merged == OutputDelta("r", (5, 6, 7), "abc", 3, True, "stop")
    with pytest.raises(ValueError, match="does not follow"):
        deltas[0].merged(deltas[2])                 # a delta in between is missing
    with pytest.raises(ValueError, match="an output was lost"):
        Transcript().add(deltas[1])
