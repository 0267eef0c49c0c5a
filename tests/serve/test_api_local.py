"""The OpenAI API over the single-instance backend with the real tiny model (no Ray)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams
from tetris.serve.api import create_api
from tetris.serve.backend import LocalEngineBackend

MODEL = "tetris-tiny-llama"


@pytest.fixture(scope="module")
def backend():
    engine = LLMEngine.from_deployment(load_deployment(), num_blocks=256)
    b = LocalEngineBackend(engine, MODEL, max_pending=8)
    yield b
    b.close()


@pytest.fixture(scope="module")
def app(backend):
    return create_api(backend)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _run(coro):
    return asyncio.run(coro)


def _reference(backend, prompt_ids: list[int], n: int) -> list[int]:
    ref = LLMEngine(backend.engine.model, backend.engine.tokenizer, num_blocks=64)
    return list(ref.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0,
                                                          ignore_eos=True))[0].token_ids)


def test_completion_matches_the_engine_and_counts_usage(app, backend):
    prompt = "Tetris fills the gaps"

    async def go():
        async with _client(app) as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                      "max_tokens": 12, "temperature": 0,
                                                      "ignore_eos": True})
            return r

    r = _run(go())
    assert r.status_code == 200, r.text
    body = r.json()
    ids = backend.tokenizer.encode(prompt)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12,
                             "total_tokens": len(ids) + 12}
    expected = backend.tokenizer.decode(_reference(backend, ids, 12))
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "length"


def test_streaming_concatenates_to_the_unary_text_and_ends_with_done(app):
    req = {"model": MODEL, "prompt": [256, 72, 105, 33], "max_tokens": 10, "temperature": 0,
           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def go():
        async with _client(app) as c:
            async with c.stream("POST", "/v1/completions", json=req) as r:
                lines = [line async for line in r.aiter_lines() if line]
            # stream_options goes with stream: true only (a 400 otherwise, as in vLLM)
            unary = await c.post("/v1/completions",
                                 json=req | {"stream": False, "stream_options": None})
            return lines, unary.json()

    lines, unary = _run(go())
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(line.startswith("data: ") for line in lines)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == unary["choices"][0]["text"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt is empty"),
        ({"model": MODEL, "prompt": [1] * 40000}, 400, "maximum context length"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens is too large"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"model": MODEL, "prompt": [99999]}, 400, "outside the vocabulary"),
        ({"model": MODEL, "prompt": [2**40]}, 400, "token ids must be int32"),
        ({"model": MODEL, "prompt": [-1]}, 400, "outside the vocabulary"),
        ({"model": MODEL}, 400, "prompt"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(app, body, status, fragment):
    async def go():
        async with _client(app) as c:
            bad = await c.post("/v1/completions", json=body)
            good = await c.post("/v1/completions", json={"model": MODEL, "prompt": "ok",
                                                          "max_tokens": 2})
            return bad, good

    bad, good = _run(go())
    assert bad.status_code == status, bad.text
    err = bad.json()["error"]
    assert fragment in err["message"] and err["type"]
    assert good.status_code == 200


def test_malformed_json_is_a_400(app):
    async def go():
        async with _client(app) as c:
            return await c.post("/v1/completions", content=b"{not json",
                                headers={"content-type": "application/json"})

    r = _run(go())
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_openai_client_completions_and_chat(app):
    openai = pytest.importorskip("openai")

    async def go():
        async with _client(app) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http)
            comp = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5,
                                                   temperature=0)
            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                temperature=0)
            pieces = []
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                temperature=0, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
            models = await client.models.list()
            return comp, chat, "".join(pieces), models

    comp, chat, streamed, models = _run(go())
    assert comp.usage.completion_tokens <= 5 and comp.choices[0].finish_reason in ("stop", "length")
    assert chat.choices[0].message.role == "assistant"
    assert streamed == chat.choices[0].message.content
    assert [m.id for m in models.data] == [MODEL]


def test_metrics_and_health(app):
    async def go():
        async with _client(app) as c:
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "m", "max_tokens": 3,
                                                  "ignore_eos": True})
            return (await c.get("/metrics")).text, (await c.get("/health")).json()

    text, health = _run(go())
    assert health["status"] == "ok"
    assert "tetris:time_to_first_token_seconds_count" in text
    assert "tetris:kv_cache_usage_perc" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(app):
    """A real uvicorn server on a loopback port (httpx's ASGI transport buffers whole bodies)."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(backend, app):
    with _serving(app) as url:
        _disconnect_five_times(backend, url)


def _disconnect_five_times(backend, url):
    free_before = backend.engine.num_free_blocks
    for _ in range(5):
        with httpx.Client(base_url=url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "x" * 50, "max_tokens": 400,
                    "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # read one event
                r.close()  # and hang up
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (backend.engine.has_unfinished()
                                           or backend.engine.num_free_blocks != free_before):
        time.sleep(0.05)
    assert not backend.engine.has_unfinished()
    assert backend.engine.num_free_blocks == free_before
    assert backend.stats()["running"] == 0


def test_overload_beyond_the_bounded_queue_gets_429_with_retry_after(backend):
    # A full-context cache, so the held request cannot finish at a small cache's length limit.
    small = LocalEngineBackend(backend.engine.__class__(backend.engine.model, backend.engine.tokenizer,
                                                        num_blocks=2048), MODEL, max_pending=1)
    app = create_api(small)

    try:
        with _serving(app) as url, httpx.Client(base_url=url, timeout=30) as c:
            # Long enough that it is still generating (or blocked on the socket) while we ask.
            with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "x", "max_tokens": 30000, "ignore_eos": True,
                    "stream": True}) as held:
                assert held.status_code == 200
                # Keep the iterator: closing httpx's line iterator closes the response (a hang-up).
                events = held.iter_lines()
                next(events)
                second = c.post("/v1/completions", json={"model": MODEL, "prompt": "y"})
            # Hanging up aborts the held request; a client honouring Retry-After gets through.
            deadline = time.monotonic() + 30
            while True:
                after = c.post("/v1/completions", json={"model": MODEL, "prompt": "y",
                                                        "max_tokens": 2})
                if after.status_code != 429 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
    finally:
        small.close()
    assert second.status_code == 429
    assert int(second.headers["retry-after"]) >= 1
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert after.status_code == 200


class _HeldOpen:
    """A backend that keeps every request in flight until released, to look at the ingress's
    memory while a generation runs."""

    model_name = MODEL
    max_model_len = 1 << 20

    def __init__(self):
        from tetris.model.tokenizer import ByteTokenizer
        self.tokenizer = ByteTokenizer()
        self.in_flight = asyncio.Event()
        self.release = asyncio.Event()

    async def generate(self, req):
        from tetris.engine.request import OutputDelta

        def out(done: bool) -> OutputDelta:
            return OutputDelta(req.request_id, (65,), "A", 1 + done, done, "length" if done else None)
        yield out(False)
        self.in_flight.set()
        await self.release.wait()
        yield out(True)

    def stats(self) -> dict:
        return {}


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_id_prompt_is_not_held_as_python_ints_while_it_generates(stream):
    """A 100k-token prompt sent as ids is parsed into 100k Python ints (32 B each past the
    small-int cache, 4 MB with their list); the request in flight keeps only its int32 ids
    (400 kB) and the body's bytes, not those ints."""
    import gc
    import tracemalloc

    n = 100_000
    backend = _HeldOpen()
    app = create_api(backend)
    body = json.dumps({"model": MODEL, "prompt": [1000 + i % 7 for i in range(n)],
                       "max_tokens": 2, "stream": stream}).encode()

    async def go():
        async with _client(app) as c:
            tracemalloc.start()
            try:
                gc.collect()
                before = tracemalloc.get_traced_memory()[0]
                post = asyncio.ensure_future(c.post("/v1/completions", content=body,
                                                    headers={"content-type": "application/json"}))
                await backend.in_flight.wait()
                gc.collect()
                during = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            backend.release.set()
            return during, await post

    during, r = _run(go())
    assert r.status_code == 200, r.text
    if not stream:
        assert r.json()["usage"]["prompt_tokens"] == n
    # the client's and the server's copy of the body (~600 kB each) and the int32 ids (400 kB)
    assert during < 2.5 * 2 ** 20, f"{during / 2 ** 20:.2f} MiB held while generating"


def test_the_openapi_document_describes_the_request_bodies(app):
    """The routes parse their own bodies; the document still says what they take."""
    async def go():
        async with _client(app) as c:
            return (await c.get("/openapi.json")).json()

    doc = _run(go())
    schemas = doc["components"]["schemas"]

    def body(path: str) -> dict:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return schemas[ref["$ref"].rsplit("/", 1)[1]]

    completion, chat = body("/v1/completions"), body("/v1/chat/completions")
    assert {"model", "prompt"} <= set(completion["required"])
    assert "max_tokens" in completion["properties"]
    messages = chat["properties"]["messages"]["items"]["$ref"].rsplit("/", 1)[1]
    assert "role" in schemas[messages]["properties"]            # nested models resolve too
    stream_options = completion["properties"]["stream_options"]["anyOf"][0]["$ref"]
    assert stream_options.rsplit("/", 1)[1] in schemas
