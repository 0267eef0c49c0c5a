"""Sampling: greedy, temperature, top-k, top-p, seeds, stop tokens and stop strings."""

from __future__ import annotations

import pytest
import torch

from tetris.engine.request import FinishReason, Sequence
from tetris.engine.sampling import (check_stop, draw, greedy_tokens, position_seed,
                                    process_logits, sample)
from tetris.sampling_params import SamplingParams


def _seq(params: SamplingParams, seed: int | None = None, stop_ids=(), prompt=(1, 2)):
    return Sequence("r", list(prompt), params, seed=seed, stop_token_ids=frozenset(stop_ids),
                    max_total_tokens=100)


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, -1.0, 4.9]])
    seqs = [_seq(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert sample(logits, seqs) == [1, 0]


def test_top_k_keeps_exactly_k_most_likely():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, True, False, False]
    expect = torch.softmax(torch.tensor([4.0, 3.0]), 0)
    torch.testing.assert_close(probs[[1, 2]], expect)


def test_top_p_keeps_smallest_set_reaching_p():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log()
    kept = process_logits(logits, SamplingParams(top_p=0.8)) > 0
    assert kept.tolist() == [True, True, False, False]
    kept = process_logits(logits, SamplingParams(top_p=0.81)) > 0
    assert kept.tolist() == [True, True, True, False]
    # The most likely token survives even a tiny top_p.
    kept = process_logits(logits, SamplingParams(top_p=0.01)) > 0
    assert kept.tolist() == [True, False, False, False]


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = process_logits(logits, SamplingParams(temperature=0.25))
    hot = process_logits(logits, SamplingParams(temperature=4.0))
    assert cold[0] > torch.softmax(logits, 0)[0] > hot[0]
    torch.testing.assert_close(hot, torch.softmax(logits / 4.0, 0))


def test_same_seed_same_tokens_regardless_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=1.0, seed=123)
    alone = [sample(logits[2:3], [_seq(params, seed=123)])[0] for _ in range(1)]
    others = [_seq(SamplingParams(temperature=1.0), seed=s) for s in (5, 6, 7)]
    batch = sample(logits[[0, 1, 2, 3]],
                   [others[0], others[1], _seq(params, seed=123), others[2]])
    assert batch[2] == alone[0]
    # A draw is keyed by (seed, position): 20 steps from seed 123 repeat exactly, and vary;
    # the same position drawn again (a resumed request) draws the same.
    a, b = _seq(params, seed=123), _seq(params, seed=123)

    def steps(seq):
        out = []
        for _ in range(20):
            out.append(sample(logits[:1], [seq])[0])
            seq.tokens.append(out[-1])
        return out

    draws_a, draws_b = steps(a), steps(b)
    assert draws_a == draws_b and len(set(draws_a)) > 1
    resumed = _seq(params, seed=123, prompt=(1, 2, *draws_a[:7]))
    assert steps(resumed)[:13] == draws_a[7:]
    assert draws_a != steps(_seq(params, seed=124))


def test_a_seeded_draw_depends_on_seed_and_position_only():
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)), 0)
    gen = torch.Generator()
    assert draw(probs, 7, 40) == draw(probs, 7, 40, gen) == draw(probs, 7, 40)
    by_position = [draw(probs, 7, p) for p in range(200)]
    by_seed = [draw(probs, s, 40) for s in range(200)]
    assert len(set(by_position)) > 100 and len(set(by_seed)) > 100
    # neighbouring seeds and positions are not shifted copies of each other
    assert sum(x == y for x, y in zip(by_position, [draw(probs, 8, p) for p in range(200)])) < 20
    assert 0 <= min(position_seed(s, p) for s in (0, 2**64 - 1) for p in (0, 10**6))
    assert max(position_seed(s, p) for s in (0, 2**64 - 1) for p in (0, 10**6)) < 2**63


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    draws = []
    seq = _seq(SamplingParams(temperature=1.0), seed=1)
    for _ in range(3000):
        draws.append(sample(logits, [seq])[0])
        seq.tokens.append(draws[-1])
    counts = torch.bincount(torch.tensor(draws), minlength=3).float() / 3000
    torch.testing.assert_close(counts, torch.softmax(logits[0], 0), atol=0.03, rtol=0)


def _decode(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def _feed(seq, tokens):
    """Append tokens until one finishes the sequence, as the engine does."""
    reasons = []
    for t in tokens:
        seq.tokens.append(t)
        reasons.append(check_stop(seq, t, _decode))
        if reasons[-1] is not None:
            break
    return reasons


def test_stop_string_is_trimmed_from_text():
    seq = _seq(SamplingParams(max_tokens=50, stop=("cd",)))
    reasons = _feed(seq, [0, 1, 2, 3, 4])  # "abcde": "cd" completes at the 4th token
    assert reasons == [None, None, None, FinishReason.STOP]
    assert seq.text == "ab"


def test_stop_token_ends_and_stays_out_of_text():
    seq = _seq(SamplingParams(max_tokens=50), stop_ids=(3,))
    assert _feed(seq, [0, 1, 3]) == [None, None, FinishReason.STOP]
    assert seq.text == "ab" and seq.output_token_ids == [0, 1, 3]


def test_max_tokens_and_context_limit_give_length():
    seq = _seq(SamplingParams(max_tokens=3))
    assert _feed(seq, [0, 0, 0]) == [None, None, FinishReason.LENGTH]
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=50), seed=None,
                   stop_token_ids=frozenset(), max_total_tokens=4)
    assert _feed(seq, [0, 0]) == [None, FinishReason.LENGTH]


def test_streamed_text_never_shows_a_stop_string_prefix():
    seq = _seq(SamplingParams(max_tokens=50, stop=("cde",)))
    deltas = []
    for t in [0, 1, 2, 3, 4]:
        seq.tokens.append(t)
        if check_stop(seq, t, _decode):
            seq.finish(FinishReason.STOP)
        deltas.append(seq.to_output((t,)).new_text)
        if seq.is_finished:
            break
    assert "".join(deltas) == "ab" == seq.text


def test_logit_rows_must_match_sequences():
    with pytest.raises(ValueError, match="2 logit rows for 1"):
        sample(torch.zeros(2, 3), [_seq(SamplingParams())])


def _run_detok(decode, tokens, final_at_end=True):
    seq = _seq(SamplingParams(max_tokens=len(tokens)))
    texts = []
    for t in tokens:
        seq.tokens.append(t)
        check_stop(seq, t, decode)
        texts.append(seq.text)
    return texts


def test_incremental_text_matches_full_decode_for_multibyte_utf8():
    from tetris.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer(320)
    data = list("héllo wörld ✓ 漢字 done".encode())
    texts = _run_detok(tok.decode, data)
    assert texts[-1] == tok.decode(data)
    for i, text in enumerate(texts):
        assert "\ufffd" not in text  # never shows half a character
        assert tok.decode(data[:i + 1]).startswith(text)


def test_incremental_text_with_a_tokenizer_that_strips_the_leading_space():
    words = ["▁The", "▁gap", "s", "▁fill", "▁up", ".", "▁Tetris", "▁wins", "!"] * 3

    def decode(ids):  # SentencePiece-like: "▁" is a space, dropped at the start of the text
        return "".join(words[i] for i in ids).replace("▁", " ").lstrip(" ")

    ids = list(range(len(words)))
    assert _run_detok(decode, ids)[-1] == decode(ids)


def test_length_finish_flushes_an_incomplete_character():
    from tetris.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer(320)
    data = list("ab✓".encode())[:-1]  # the check mark cut after two of its three bytes
    assert _run_detok(tok.decode, data)[-1] == tok.decode(data) == "ab\ufffd"


def _top_p_by_full_sort(logits, top_p):
    probs = torch.softmax(logits, 0)
    vals, idx = torch.sort(probs, descending=True)
    keep = (torch.cumsum(vals, 0) - vals) < top_p
    out = torch.zeros_like(probs)
    out[idx[keep]] = vals[keep]
    return out / out.sum()


@pytest.mark.parametrize("spread", [0.3, 8.0])  # a flat nucleus (thousands of tokens), a peaked one
def test_top_p_over_a_large_vocab_equals_a_full_sort(spread):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5000, generator=gen) * spread
    got = process_logits(logits, SamplingParams(top_p=0.9))
    want = _top_p_by_full_sort(logits, 0.9)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want)
    kept = int((got > 0).sum())
    assert (kept > 256) if spread < 1 else (kept < 256)


def _tied_logits(dtype, vocab, seed):
    """[5, vocab] logits with few distinct values, so rows hold many tied maxima."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randint(-3, 3, (5, vocab), generator=gen) / 4).to(dtype)
    logits[1, -1] = 2.0                     # one maximum, in the last position
    logits[2, [7, vocab // 2, vocab - 3]] = 3.0  # tied maxima in different blocks
    logits[3, [vocab // 3, vocab - 2]] = float("nan")  # argmax takes the first NaN
    logits[4] = float("-inf")               # all tied: index 0
    return logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab", [1024, 32000, 320, 10])
def test_greedy_tokens_are_the_fp32_argmax_ties_included(dtype, vocab):
    """Blocked (vocab 1024, 32000) and fallback (320, 10) paths: the first maximal index of the
    fp32 upcast, the tie rule of ``argmax``, in every row."""
    for seed in range(4):
        logits = _tied_logits(dtype, vocab, seed)
        want = logits.float().argmax(dim=-1)
        got = greedy_tokens(logits)
        assert got.dtype == torch.int64
        assert got.tolist() == want.tolist(), (seed, got, want)
    first = min(7, vocab // 2, vocab - 3)
    assert greedy_tokens(_tied_logits(dtype, vocab, 0))[2] == first  # not a later tied one


def test_greedy_tokens_of_a_strided_view_and_bad_shape():
    logits = _tied_logits(torch.bfloat16, 2048, 0)
    cols = logits.t().contiguous().t()  # same values, column-major
    assert greedy_tokens(cols).tolist() == logits.float().argmax(-1).tolist()
    sliced = logits[:, :1024]  # rows 2048 apart, contiguous within: the blocked path
    assert greedy_tokens(sliced).tolist() == sliced.float().argmax(-1).tolist()
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        greedy_tokens(logits[0])


def test_random_rows_of_bf16_logits_sample_as_their_fp32_upcast():
    """A batch mixing greedy and random rows: greedy rows take the argmax, random rows draw
    exactly what they draw from the fp32 copy of the same logits."""
    torch.manual_seed(2)
    logits = (torch.randn(4, 512) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, seed=9),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=20, seed=4)]

    def draw(rows):
        return sample(rows, [_seq(p, seed=p.seed) for p in params])

    for _ in range(5):
        assert draw(logits) == draw(logits.float())
    got = draw(logits)
    assert [got[0], got[2]] == logits.float().argmax(-1)[[0, 2]].tolist()
