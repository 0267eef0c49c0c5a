"""Helpers of the OpenAI field tests: the single-engine app on the tiny model, requests over
httpx's ASGI transport, SSE parsing, and log-softmax references from a plain forward."""

from __future__ import annotations

import asyncio
import json

import httpx
import torch

from tetris.config import load_deployment
from tetris.engine.engine import LLMEngine
from tetris.kernels.attention import attention_with_lse_ref
from tetris.serve.api import create_api
from tetris.serve.backend import LocalEngineBackend

MODEL = "tetris-tiny-llama"


def local_backend(max_pending: int = 64) -> LocalEngineBackend:
    engine = LLMEngine.from_deployment(load_deployment(), num_blocks=512)
    return LocalEngineBackend(engine, MODEL, max_pending=max_pending)


def run(coro):
    return asyncio.run(coro)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             timeout=120)


async def post(c: httpx.AsyncClient, path: str, body: dict):
    """(status, JSON body) of a unary request, or (status, list of SSE events) of a streamed
    one (the events before ``[DONE]``, which must end the stream)."""
    if not body.get("stream"):
        r = await c.post(path, json=body)
        return r.status_code, r.json()
    async with c.stream("POST", path, json=body) as r:
        lines = [line async for line in r.aiter_lines() if line]
    if r.status_code != 200:
        return r.status_code, json.loads(lines[0])
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return r.status_code, [json.loads(line[len("data: "):]) for line in lines[:-1]]


def app_for(backend):
    return create_api(backend)


def _causal(layer, q, k, v):
    return attention_with_lse_ref(q, k, v, causal=True)[0]


@torch.inference_mode()
def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: log_softmax of the logits at every position, from one plain forward
    of the whole sequence (no cache, no batching, no chunks)."""
    hidden = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), _causal)
    return torch.log_softmax(model.logits(hidden).float(), dim=-1)
