"""The first token streamed at the prefill's end: the client's stream is the decode engine's,
each token and character exactly once, whatever the hold-back rules delay."""

from __future__ import annotations

import asyncio

import pytest

from tetris.engine.request import OutputDelta, Sequence
from tetris.engine.sampling import check_stop
from tetris.model.tokenizer import ByteTokenizer
from tetris.sampling_params import SamplingParams
from tetris.serve.first_token import EarlyFirstToken
from tetris.serve.protocol import GenerateRequest

TOK = ByteTokenizer(512)
EOS = TOK.eos_token_ids


def _engine_stream(prompt, tokens, params, max_len=4096):
    """The outputs a decode engine gives for ``tokens`` (commit_prefilled + steps: the same
    Sequence / check_stop / to_output calls)."""
    stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(EOS))
    seq = Sequence("r", list(prompt), params, seed=None, stop_token_ids=stop_ids,
                   max_total_tokens=max_len)
    outs = []
    for t in tokens:
        seq.tokens.append(t)
        reason = check_stop(seq, t, TOK.decode)
        if reason is not None:
            seq.finish(reason)
        outs.append(seq.to_output((t,)))
        if reason is not None:
            break
    return outs


def _bytes_ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


CASES = [
    ("plain", "hello world", SamplingParams(max_tokens=11, ignore_eos=True)),
    ("two-byte first character", "\u00e9t\u00e9 ok", SamplingParams(max_tokens=8, ignore_eos=True)),
    ("four-byte character", "\U0001f600 fin", SamplingParams(max_tokens=8, ignore_eos=True)),
    ("stop string spans the first token", "ab##cd", SamplingParams(max_tokens=6, stop=("b##",))),
    ("stop string later", "xyz END tail", SamplingParams(max_tokens=12, stop=("END",))),
]


@pytest.mark.parametrize("name, text, params", CASES, ids=[c[0] for c in CASES])
def test_client_stream_equals_the_engine_stream(name, text, params):
    prompt = [5, 6, 7]
    tokens = _bytes_ids(text)[:params.max_tokens]
    engine = _engine_stream(prompt, tokens, params)
    early = EarlyFirstToken(TOK.decode, EOS, 4096).open(
        GenerateRequest("r", tuple(prompt), params), tokens[0])
    assert early is not None and early.first.new_token_ids == (tokens[0],)
    assert not early.first.finished
    sent = [early.first] + [o for o in (early.follow(OutputDelta.of(out)) for out in engine) if o is not None]
    ids = [t for o in sent for t in o.new_token_ids]
    assert ids == list(engine[-1].token_ids)
    assert "".join(o.new_text for o in sent) == engine[-1].text
    assert sent[-1].finished and sent[-1].finish_reason == engine[-1].finish_reason
    assert not any(o.finished for o in sent[:-1])


def test_a_first_token_that_ends_the_request_is_not_sent_early():
    early = EarlyFirstToken(TOK.decode, EOS, 4096)
    req = GenerateRequest("r", (1, 2), SamplingParams(max_tokens=4))
    assert early.open(req, EOS[0]) is None                                   # EOS
    assert early.open(GenerateRequest("r", (1, 2), SamplingParams(max_tokens=1)), 65) is None
    assert early.open(GenerateRequest("r", (1,) * 4095, SamplingParams(max_tokens=4)), 65) is None
    ignore = GenerateRequest("r", (1, 2), SamplingParams(max_tokens=4, ignore_eos=True))
    assert early.open(ignore, EOS[0]) is not None
    # without a tokenizer, ids only; stop strings cannot be held back, so nothing early
    bare = EarlyFirstToken(None, (), 4096)
    assert bare.open(req, 65).first.new_text == ""
    assert bare.open(GenerateRequest("r", (1,), SamplingParams(max_tokens=4, stop=("x",))), 65) is None


def test_dispatcher_yields_the_first_token_before_the_decode_hand_off():
    from test_dispatcher import FakeDecode, _dispatcher, _req

    gate = asyncio.Event()

    class SlowCommit(FakeDecode):
        async def commit(self, instance, request_id, first_token):
            await gate.wait()   # the KV hand-off has not finished
            await super().commit(instance, request_id, first_token)

    async def go():
        d = _dispatcher(decode=SlowCommit(), first_token=EarlyFirstToken(None, (), 1 << 20))
        gen = d.generate(_req("a", 600, 4))
        first = await asyncio.wait_for(gen.__anext__(), 5.0)
        gate.set()
        rest = [o async for o in gen]
        return d, first, rest

    d, first, rest = asyncio.run(go())
    assert first.new_token_ids == (600 % 7,) and not first.finished
    assert [t for o in rest for t in o.new_token_ids] == [600 % 7 + i for i in range(1, 4)]
    assert rest[-1].finished
    (tl,) = d.timelines
    assert 0 < tl.first_token <= tl.first_output
    assert tl.breakdown()["ttft_s"] == pytest.approx(tl.first_token - tl.arrival)
