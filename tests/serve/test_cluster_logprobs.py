"""Logprobs on the served cluster's token path, without Ray: the first token's logprob (from the
prefill pool) streams early and is trimmed from the decode stream with its token; a request the
cluster cannot serve (prompt logprobs, repetition_penalty, min_tokens) is a 400 naming the field;
the Ray app itself is tested in test_app_e2e.py."""

from __future__ import annotations

import pytest

from tetris.config import load_deployment
from tetris.engine.request import OutputDelta, TokenLogprob
from tetris.model.tokenizer import ByteTokenizer
from tetris.sampling_params import SamplingParams
from tetris.serve.api import create_api
from tetris.serve.fields import cluster_unsupported
from tetris.serve.first_token import EarlyFirstToken
from tetris.serve.protocol import GenerateRequest

from openai_helpers import MODEL, client, post, run

TOK = ByteTokenizer(512)


def _lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.1 * token, ((token, -0.1 * token),))


def test_the_first_tokens_logprob_streams_early_and_is_trimmed_from_the_decode_stream():
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    req = GenerateRequest("r", (1, 2, 3), params)
    early = EarlyFirstToken(TOK.decode, TOK.eos_token_ids, 4096).open(req, 65, _lp(65))
    assert early.first.new_logprobs == (_lp(65),)
    # the decode engine's stream starts again with the first token (commit_prefilled)
    decode = [OutputDelta("r", (65,), "A", 1, new_logprobs=(_lp(65),)),
              OutputDelta("r", (66, 67), "BC", 3, new_logprobs=(_lp(66), _lp(67))),
              OutputDelta("r", (68,), "D", 4, True, "length", new_logprobs=(_lp(68),))]
    followed = [o for o in (early.follow(d) for d in decode) if o is not None]
    assert [t for o in followed for t in o.new_token_ids] == [66, 67, 68]
    assert [e for o in followed for e in o.new_logprobs] == [_lp(66), _lp(67), _lp(68)]
    merged = followed[0].merged(followed[1])
    assert merged.new_logprobs == (_lp(66), _lp(67), _lp(68))


class _ClusterLike:
    """A backend declaring what the Ray app declares (``_DispatcherBackend.unsupported``)."""

    model_name = MODEL
    max_model_len = 4096
    tokenizer = TOK

    def __init__(self, deployment):
        self.unsupported = cluster_unsupported(deployment)
        self.calls = 0

    async def generate(self, req):
        self.calls += 1
        yield OutputDelta(req.request_id, (65,), "A", 1, True, "length",
                          new_logprobs=(_lp(65),) if req.sampling.logprobs is not None else ())

    def stats(self):
        return {}


@pytest.mark.parametrize("fields, param", [
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"echo": True, "logprobs": 1, "max_tokens": 0}, "echo"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"min_tokens": 1}, "min_tokens"),
])
def test_what_the_cluster_cannot_serve_is_a_400_naming_the_field(fields, param):
    backend = _ClusterLike(load_deployment())
    app = create_api(backend)

    async def go():
        async with client(app) as c:
            bad = await post(c, "/v1/completions", {"model": MODEL, "prompt": "x"} | fields)
            good = await post(c, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                      "logprobs": 1, "echo": False})
            return bad, good

    (status, body), (ok, good) = run(go())
    assert status == 400 and body["error"]["param"] == param, body
    assert "single-engine server only" in body["error"]["message"]
    assert ok == 200 and good["choices"][0]["logprobs"]["token_logprobs"] == [-6.5]
    assert backend.calls == 1   # the refused request never reached the cluster


def test_an_emulated_cluster_refuses_logprobs():
    import msgspec

    cfg = load_deployment()
    emulated = msgspec.structs.replace(cfg, decode=msgspec.structs.replace(cfg.decode,
                                                                          executor="emulated"))
    assert "logprobs" in cluster_unsupported(emulated)
    assert "logprobs" not in cluster_unsupported(cfg)
