"""The whole system over HTTP on Ray Serve: CDSP prefill on the SP pool, KV streaming to a TP-2
decode instance, continuous batching, the OpenAI API, the handle API from a second app.

One app per module (Serve and the pools start once, ~20 s). The scheduler plans with a
CPU-like latency profile written by the fixture: the A100 profile with its overhead x10, its
linear term x100 and its attention terms x1000, so that at test-sized prompts (hundreds of tokens) attention dominates
as it does at 100k tokens on a GPU, and CDSP's chunking shows.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import pytest
from cluster_configs import MODEL, write_tiny_cluster
from exactness import TOP, assert_api_logprobs, engine_runs

from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(serve_http, tmp_path_factory):
    from ray import serve

    from tetris.serve.app import APP_NAME, build_app

    cfg = load_deployment(write_tiny_cluster(tmp_path_factory.mktemp("e2e")))
    serve.run(build_app(cfg, max_pending=24), name=APP_NAME, route_prefix="/")
    warm = serve.get_deployment_handle("DispatcherServer", APP_NAME).warmup.remote().result()
    assert warm["event_loop"].startswith("uvloop")     # the dispatcher runs on uvloop
    yield cfg, serve_http
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def engine(app):
    cfg, _ = app
    return LLMEngine.from_deployment(cfg, num_blocks=256)


def _reference(engine, prompts, n):
    outs = engine.generate([list(p) for p in prompts],
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o for o in outs]


def _reference_logprobs(engine, prompts, n, prefix):
    """The engine's greedy tokens and their top-``TOP`` logprobs: the served text alone would
    pass with a broken attention term (tests/exactness.py)."""
    return engine_runs(engine, prompts, SamplingParams(max_tokens=n, temperature=0,
                                                       ignore_eos=True, logprobs=TOP), prefix)


def _text_of(engine):
    from tetris.serve.logprobs_format import TokenText

    return TokenText(engine.tokenizer)


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11) % 500 + 3 for i in range(n)]


async def _complete(client, base, prompt, n, **extra):
    r = await client.post(f"{base}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, **extra})
    return r


def test_greedy_output_through_the_full_system_equals_the_engine(app, engine):
    cfg, base = app
    short, long = _prompt(200, 1), _prompt(2000, 2)

    async def both():
        async with httpx.AsyncClient(timeout=120) as c:
            # Instances 0 and 1 are drained for 2.5 s (so that the request is planned inside
            # it on a loaded machine): the long request starts on 2 and 3 and CDSP grows its
            # later chunk onto 0 and 1 (for a 2000-token prompt it does so for any drain left
            # between 1 and 3 s with this profile).
            r = await c.post(f"{base}/admin/drain", json={"instances": [0, 1], "seconds": 2.5})
            assert r.status_code == 200, r.text
            rb = await _complete(c, base, long, 24, logprobs=TOP)
            ra = await _complete(c, base, short, 24, logprobs=TOP)
            plans = (await c.get(f"{base}/admin/plans")).json()
            return ra, rb, plans

    ra, rb, plans = asyncio.run(both())
    assert ra.status_code == rb.status_code == 200, (ra.text, rb.text)
    ref = _reference(engine, [short, long], 24)
    assert ra.json()["choices"][0]["text"] == ref[0].text
    assert rb.json()["choices"][0]["text"] == ref[1].text
    # the first token's logprobs from the CDSP prefill, the rest from the TP-2 decode ranks
    for r, want, what in zip((ra, rb), _reference_logprobs(engine, [short, long], 24, "cdsp"),
                             ("short", "long")):
        assert_api_logprobs(r.json()["choices"][0]["logprobs"], want, _text_of(engine), what)
    assert rb.json()["usage"] == {"prompt_tokens": 2000, "completion_tokens": 24,
                                  "total_tokens": 2024}
    long_plan = [p for p in plans if p["prompt_tokens"] == 2000][-1]
    assert len(long_plan["chunks"]) >= 2, long_plan          # CDSP: the group grew
    assert len(long_plan["chunks"][-1]["instances"]) > len(long_plan["chunks"][0]["instances"])


def test_a_seeded_sampled_request_is_the_same_served_as_on_one_engine(app, engine):
    """A seeded draw is keyed by (seed, position): the prefill worker that samples the first
    token and the decode engine that samples the rest draw what one engine would."""
    _, base = app
    prompt = _prompt(400, 5)
    params = SamplingParams(max_tokens=16, temperature=1.3, top_k=40, seed=21, ignore_eos=True)
    want = engine.generate([prompt], params)[0]
    assert len(set(want.token_ids)) > 4      # sampled, not greedy-looking
    r = asyncio.run(_complete_once(base, prompt, 16, temperature=1.3, top_k=40, seed=21))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.text


def _engine_logprobs(engine, prompt, params) -> tuple[list[int], list]:
    """Tokens and their TokenLogprobs from the single engine (its own step loop)."""
    rid = f"logprobs-{params.seed}-{params.temperature}"
    engine.add_request(rid, prompt, params)
    tokens, entries = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                entries += out.new_logprobs
    return tokens, entries


def test_completion_top5_logprobs_served_equal_the_single_engines(app, engine):
    """The first token's logprobs come from the prefill pool, the rest from the decode ranks;
    echo with logprobs (prompt logprobs) is refused by name, not dropped."""
    from tetris.serve.logprobs_format import TokenText

    _, base = app
    prompt = _prompt(600, 7)
    cases = [{"temperature": 0}, {"temperature": 1.3, "seed": 5}]

    async def go():
        async with httpx.AsyncClient(timeout=300) as c:
            served = await asyncio.gather(*[_complete(c, base, prompt, 6, logprobs=5, **case)
                                            for case in cases])
            refused = await _complete(c, base, prompt, 0, logprobs=1, echo=True)
            return served, refused

    served, refused = asyncio.run(go())
    text_of = TokenText(engine.tokenizer)
    for case, r in zip(cases, served):
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["logprobs"]
        want = _engine_logprobs(engine, prompt, SamplingParams(
            max_tokens=6, ignore_eos=True, logprobs=5, **case))
        assert_api_logprobs(got, want, text_of, str(case))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
    assert "single-engine server only" in refused.json()["error"]["message"]


def test_handle_api_from_a_second_app_gives_the_engines_tokens(app, engine):
    from ray import cloudpickle, serve

    from tetris.serve.types import GenerationRequest

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Caller:
        async def __call__(self, prompt_ids: list[int], n: int):
            h = serve.get_app_handle("tetris")
            req = GenerationRequest(prompt_token_ids=tuple(prompt_ids),
                                    sampling=SamplingParams(max_tokens=n, temperature=0,
                                                            ignore_eos=True))
            whole = await h.generate.remote(req)
            pieces = [d async for d in h.options(stream=True).generate_stream.remote(req)]
            return whole, pieces

    caller = serve.run(Caller.bind(), name="caller", route_prefix=None)
    try:
        prompt = _prompt(300, 3)
        whole, pieces = caller.remote(prompt, 12).result(timeout_s=300)
    finally:
        serve.delete("caller")
    ref = _reference(engine, [prompt], 12)[0]
    assert list(whole.token_ids) == list(ref.token_ids)
    assert [t for p in pieces for t in p.new_token_ids] == list(ref.token_ids)
    assert pieces[-1].finished and whole.finish_reason == "length"


def test_openai_client_completions_and_chat_streaming_and_not(app):
    openai = pytest.importorskip("openai")
    _, base = app
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120)
    full = client.completions.create(model=MODEL, prompt="Tetris fills the gaps",
                                     max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="Tetris fills the gaps", max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert full.choices[0].text == streamed and full.usage.completion_tokens == 10
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []


def test_sixteen_concurrent_requests_all_complete(app, engine):
    _, base = app
    prompts = [_prompt(40 + 23 * i, i) for i in range(16)]

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*[_complete(c, base, p, 8, logprobs=TOP)
                                          for p in prompts])

    results = asyncio.run(run())
    assert [r.status_code for r in results] == [200] * 16
    ref = _reference(engine, prompts, 8)
    assert [r.json()["choices"][0]["text"] for r in results] == [o.text for o in ref]
    for i, (r, want) in enumerate(zip(results, _reference_logprobs(engine, prompts, 8, "x16"))):
        assert_api_logprobs(r.json()["choices"][0]["logprobs"], want, _text_of(engine), f"#{i}")


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": "gpt-nope", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": [5] * 5000}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(app, body, status, param):
    _, base = app
    with httpx.Client(timeout=120) as c:
        if isinstance(body, bytes):
            r = c.post(f"{base}/v1/completions", content=body,
                       headers={"content-type": "application/json"})
        else:
            r = c.post(f"{base}/v1/completions", json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"]
        if param is not None:
            assert err["param"] == param
        ok = c.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "ok",
                                                    "max_tokens": 2})
        assert ok.status_code == 200


async def _open_and_drop(client, base, prompt):
    async with client.stream("POST", f"{base}/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2000, "stream": True,
            "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break
        # leaving the block closes the connection mid-stream: the client went away


def _held(base) -> dict:
    return httpx.get(f"{base}/admin/held", timeout=60).json()


def _idle(held: dict) -> bool:
    d = held["dispatcher"]
    return (d == {"inflight": 0, "queue_bookings": 0, "virtual_usage": 0, "virtual_requests": 0, "cleanups": 0, "relayed": 0}
            and not any(held["prefill"].values())
            and all(rank["empty"] for inst in held["decode"] for rank in inst["ranks"]))


def test_two_hundred_aborted_streams_leave_nothing_reserved(app):
    _, base = app

    async def run():
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=120) as c:
            async def one(i):
                async with sem:
                    await _open_and_drop(c, base, _prompt(30 + i % 50, i))
            await asyncio.gather(*[one(i) for i in range(200)])

    asyncio.run(run())
    held = None
    for _ in range(100):          # aborts finish asynchronously
        held = _held(base)
        if _idle(held):
            break
        asyncio.run(asyncio.sleep(0.2))
    assert _idle(held), json.dumps(held, indent=1)
    ok = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "still here",
                                                    "max_tokens": 3}, timeout=120)
    assert ok.status_code == 200


def test_overload_gets_429_with_retry_after_not_a_crash(app):
    _, base = app

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            async def one(i):
                return await c.post(f"{base}/v1/completions", json={
                    "model": MODEL, "prompt": _prompt(20, i), "max_tokens": 64,
                    "ignore_eos": True})
            return await asyncio.gather(*[one(i) for i in range(40)])

    results = asyncio.run(run())
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    refused = next(r for r in results if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"


def test_metrics_expose_tetris_names(app):
    _, base = app
    text = httpx.get(f"{base}/metrics", timeout=60).text
    for name in ("tetris:time_to_first_token_seconds", "tetris:inter_token_latency_seconds",
                 "tetris:e2e_request_latency_seconds", "tetris:request_queue_time_seconds",
                 "tetris:prefill_chunks_per_request", "tetris:prefill_chunk_sp_size",
                 "tetris:kv_cache_usage_perc", "tetris:improvement_rate"):
        assert name in text, name
    count = [ln for ln in text.splitlines()
             if ln.startswith('tetris:prefill_chunks_per_request_count')]
    assert count and float(count[0].split()[-1]) >= 2


def test_admin_rate_table_round_trip_and_bad_table_refused(app):
    _, base = app
    with httpx.Client(timeout=60) as c:
        r = c.put(f"{base}/admin/rate_table", json={"rates": [0.5, 2.0],
                                                   "improvement_rates": [0.0, 0.2]})
        assert r.status_code == 200 and r.json()["rates"] == [0.5, 2.0]
        bad = c.put(f"{base}/admin/rate_table", json={"rates": [1.0], "improvement_rates": [3]})
        assert bad.status_code == 400 and "error" in bad.json()
        assert c.get(f"{base}/admin/rate_table").json()["improvement_rates"] == [0.0, 0.2]
        prof = c.get(f"{base}/admin/latency_profile").json()
        assert c.put(f"{base}/admin/latency_profile", json=prof).json() == prof
        assert json.dumps(prof)


def test_a_prefill_worker_that_dies_idle_is_replaced_before_a_request_needs_it(app, engine):
    """No request runs when prefill worker 1 dies: the dispatcher's periodic probe finds it and
    the pool replaces it, so the next request planned onto instance 1 runs without a retry."""
    import ray
    from ray import serve

    from tetris.serve.app import APP_NAME

    _, base = app
    prefill = serve.get_deployment_handle("PrefillPoolServer", APP_NAME)
    dispatcher = serve.get_deployment_handle("DispatcherServer", APP_NAME)
    with pytest.raises(ray.exceptions.RayTaskError, match="must be >= 0"):
        dispatcher.set_prefill_check.remote(-1).result()
    before = prefill.replacements.remote().result()
    ray.kill(prefill.peers.remote().result()[1][0])
    deadline = time.monotonic() + 120   # a loaded machine takes tens of seconds to start one
    while prefill.replacements.remote().result() == before:
        assert time.monotonic() < deadline, "the dead idle worker was not replaced"
        time.sleep(0.2)
    assert prefill.replacements.remote().result() == before + 1
    prompt = _prompt(500, 12)
    want = _reference(engine, [prompt], 8)[0].text
    httpx.post(f"{base}/admin/drain", json={"instances": [0, 2, 3], "seconds": 60.0}, timeout=60)
    r = asyncio.run(_complete_once(base, prompt, 8))
    httpx.post(f"{base}/admin/drain", json={"instances": [0, 2, 3], "seconds": 0.001}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    (tl,) = dispatcher.timelines.remote(1).result()
    assert tl["retries"] == 0
    plans = httpx.get(f"{base}/admin/plans", timeout=60).json()
    assert 1 in plans[-1]["chunks"][0]["instances"]


def test_a_dead_prefill_worker_is_replaced_and_streams_kv_to_decode_again(app, engine):
    """Kills prefill worker 0. The pool replaces it when a plan reaches it, the decode ranks
    learn the new sender at once, and the request whose chunk lost the worker is planned again
    (the dispatcher retries ``PrefillWorkerLost``): it streams its KV from the replacement,
    decodes as the engine does, and its client never sees the loss."""
    import ray
    from ray import serve

    from tetris.serve.app import APP_NAME

    _, base = app
    prefill = serve.get_deployment_handle("PrefillPoolServer", APP_NAME)
    dispatcher = serve.get_deployment_handle("DispatcherServer", APP_NAME)
    before = prefill.replacements.remote().result()
    # the periodic probe off, so that the chunk finds the dead worker (not the probe first)
    period = dispatcher.set_prefill_check.remote(0).result()
    try:
        ray.kill(prefill.peers.remote().result()[0][0])
        prompt = _prompt(600, 10)
        want = _reference(engine, [prompt], 12)[0].text
        want_lp = _reference_logprobs(engine, [prompt], 12, "replaced")[0]
        # instances 1-3 held for longer than an instance being replaced counts as busy
        # (LiveQueue.REPLACING_S): the plan lands on instance 0, dead, and so does the run
        # again: the pool refuses it while instance 0 is being replaced (InstanceReplacing
        # through the handle), and the last plan the dispatcher tries waits for the replacement
        httpx.post(f"{base}/admin/drain", json={"instances": [1, 2, 3], "seconds": 120.0}, timeout=60)
        r = asyncio.run(_complete_once(base, prompt, 12, logprobs=TOP))
        httpx.post(f"{base}/admin/drain", json={"instances": [1, 2, 3], "seconds": 0.001}, timeout=60)
    finally:
        dispatcher.set_prefill_check.remote(period).result()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    assert_api_logprobs(r.json()["choices"][0]["logprobs"], want_lp, _text_of(engine), "rerun")
    assert prefill.replacements.remote().result() == before + 1
    (tl,) = dispatcher.timelines.remote(1).result()
    assert tl["retries"] == 1 and tl["outcome"] == "length"
    plans = httpx.get(f"{base}/admin/plans", timeout=60).json()
    assert plans[-1]["request_id"].endswith("#retry1")
    assert {0} <= set(plans[-1]["chunks"][0]["instances"])
    metrics = httpx.get(f"{base}/metrics", timeout=60).text.splitlines()
    assert f'tetris:request_retries_total{{model_name="{MODEL}",stage="prefill"}} 1.0' in metrics


def test_a_dead_decode_rank_is_replaced_and_its_streams_resume(app, engine):
    """Runs last in this module: it kills a TP rank of the only decode instance while a request
    streams from it. The dispatcher's health check finds the instance broken, stops routing
    there (a new request meanwhile gets a 429 with Retry-After), restarts it with new ranks and
    hands the prefill workers the new transfer agents. The streaming request waits for it, is
    prefilled again with the tokens its client already has, and goes on: the client's text is
    exactly the engine's, each token once. Nothing is left held."""
    import threading
    import time

    import ray
    from ray import serve

    from tetris.serve.app import APP_NAME

    _, base = app
    decode = serve.get_deployment_handle("DecodePoolServer", APP_NAME)
    dispatcher = serve.get_deployment_handle("DispatcherServer", APP_NAME)
    old = decode.peers.remote().result()
    prompt, n = _prompt(300, 9), 400
    want = _reference(engine, [prompt], n)[0]
    want_lp = _reference_logprobs(engine, [prompt], n, "resumed")[0]
    pieces: list[str] = []
    logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    usage: dict = {}
    enough = threading.Event()

    def stream():
        with httpx.stream("POST", f"{base}/v1/completions", timeout=240, json={
                "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": TOP,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    usage.update(chunk["usage"])
                pieces.extend(c["text"] for c in chunk["choices"])
                for c in chunk["choices"]:
                    for key, got in logprobs.items():
                        got.extend(c["logprobs"][key])
                if len(pieces) >= 4:
                    enough.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert enough.wait(120), "the stream never started"
    ray.kill(old[1][0])                                  # TP rank 1 of decode instance 0
    deadline = time.monotonic() + 240
    while dispatcher.stats.remote().result()["decode_restarts"].get(0, 0) < 1:
        assert time.monotonic() < deadline, "the decode instance was never restarted"
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "meanwhile",
                                                       "max_tokens": 2}, timeout=120)
        assert r.status_code in (200, 429), r.text
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
        time.sleep(0.5)
    reader.join(240)
    assert not reader.is_alive()
    assert "".join(pieces) == want.text and usage["completion_tokens"] == n
    # the resumed run's tokens (prefilled again with those the client had) read the same logits
    assert_api_logprobs(logprobs, want_lp, _text_of(engine), "resumed")
    streamed = [t for t in dispatcher.timelines.remote(50).result() if t["prompt_tokens"] == 300]
    assert streamed[-1]["retries"] == 1 and streamed[-1]["outcome"] == "length"
    metrics = httpx.get(f"{base}/metrics", timeout=60).text.splitlines()
    assert f'tetris:request_retries_total{{model_name="{MODEL}",stage="decode"}} 1.0' in metrics

    new = decode.peers.remote().result()
    assert set(new) == set(old)
    assert all(new[rid][0]._actor_id != old[rid][0]._actor_id for rid in old)   # new ranks
    assert dispatcher.stats.remote().result()["decode_down"] == []
    assert f'tetris:decode_instance_up{{instance="0",model_name="{MODEL}"}} 1.0' in metrics
    assert f'tetris:decode_instance_restarts_total{{instance="0",model_name="{MODEL}"}} 1.0' in metrics

    prompt = _prompt(300, 11)
    r = asyncio.run(_complete_once(base, prompt, 16))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _reference(engine, [prompt], 16)[0].text
    held = None
    for _ in range(100):
        held = _held(base)
        if _idle(held):
            break
        time.sleep(0.2)
    assert _idle(held), json.dumps(held, indent=1)


async def _complete_once(base, prompt, n, **extra):
    async with httpx.AsyncClient(timeout=120) as c:
        return await _complete(c, base, prompt, n, **extra)
