"""Elastic decode served over HTTP (issue #25, Ray Serve, the SP pool, NIXL streaming): the
tiny cluster with two decode instances of TP 2 and 32 KV blocks each (512 tokens) under
``[decode] elastic = true``. A prompt of 700 tokens fits neither instance (whole placement
refuses it with 429: ``DecodeFull``) but fits their sum: the dispatcher places it over both,
the prefill pool streams each range to its holder, and its greedy text equals the engine's,
while a small request decodes on the same instances. A prompt beyond their sum is refused.

One app for the module (one deploy).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from cluster_configs import MODEL, write_tiny_cluster
from served_held import assert_idle_soon

from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

BLOCKS = 32          # per decode instance: 512 tokens of 16
MAX_TOKENS = 8


def _write_deployment(tmp) -> str:
    path = Path(write_tiny_cluster(tmp))
    text = path.read_text()
    whole = "[decode]\nnum_instances = 1\ntp_size = 2\nkv_blocks = 512\n"
    assert whole in text
    path.write_text(text.replace(whole, f"[decode]\nnum_instances = 2\ntp_size = 2\n"
                                        f"kv_blocks = {BLOCKS}\nelastic = true\n"))
    return str(path)


@pytest.fixture(scope="module")
def app(serve_http, tmp_path_factory):
    from ray import serve

    from tetris.serve.app import APP_NAME, build_app

    cfg = load_deployment(_write_deployment(tmp_path_factory.mktemp("elastic")))
    assert cfg.decode.elastic and cfg.decode.num_instances == 2
    serve.run(build_app(cfg, max_pending=8), name=APP_NAME, route_prefix="/")
    yield cfg, serve_http
    serve.delete(APP_NAME)


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11) % 500 + 3 for i in range(n)]


def _body(prompt) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}


def test_a_prompt_bigger_than_any_instance_is_served_over_both(app):
    cfg, base = app
    capacity = BLOCKS * cfg.decode.block_size
    long_prompt, short_prompt = _tokens(700, 1), _tokens(40, 2)
    # bigger than either instance's KV, within their sum (output included)
    assert capacity < len(long_prompt) and len(long_prompt) + MAX_TOKENS <= 2 * capacity
    engine = LLMEngine.from_deployment(cfg, num_blocks=128)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = [o.text for o in engine.generate([long_prompt, short_prompt], params)]

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*[c.post(f"{base}/v1/completions", json=_body(p))
                                          for p in (long_prompt, short_prompt)])

    responses = asyncio.run(run())
    for r in responses:
        assert r.status_code == 200, r.text
    assert [r.json()["choices"][0]["text"] for r in responses] == want
    assert responses[0].json()["usage"]["completion_tokens"] == MAX_TOKENS
    # every range released on both instances, the prefill copies of all ranges freed
    assert_idle_soon(base)


def test_a_prompt_beyond_the_instances_sum_is_refused(app):
    cfg, base = app
    too_long = _tokens(2 * BLOCKS * cfg.decode.block_size + 1, 3)
    r = httpx.post(f"{base}/v1/completions", json=_body(too_long), timeout=300)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    # and nothing was left behind: a request that fits is still served, then nothing is held
    ok = httpx.post(f"{base}/v1/completions", json=_body(_tokens(30, 4)), timeout=300)
    assert ok.status_code == 200, ok.text
    assert_idle_soon(base)


def _used(held: dict) -> list[list[int]]:
    """Blocks in use per decode instance and TP rank."""
    return [[r["total_blocks"] - r["free_blocks"] for r in inst["ranks"]]
            for inst in held["decode"]]


def test_a_split_stream_closed_by_its_client_frees_every_range(app):
    """Abort: a 700-token request streams from its group and its client leaves after three
    chunks; every range on both instances is freed (every rank's used blocks back to 0)."""
    cfg, base = app
    body = _body(_tokens(700, 5)) | {"max_tokens": 200, "stream": True}
    assert 700 > BLOCKS * cfg.decode.block_size   # a group over both instances
    with httpx.stream("POST", f"{base}/v1/completions", timeout=300, json=body) as r:
        assert r.status_code == 200, r.read()
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                during = httpx.get(f"{base}/admin/held", timeout=60).json()
                break   # leaving the block closes the connection mid-stream
    assert all(u > 0 for inst in _used(during) for u in inst), _used(during)
    assert_idle_soon(base)

