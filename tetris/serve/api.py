"""The OpenAI-compatible HTTP API over any ``GenerationBackend``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming,
``stream_options.include_usage`` and usage counts), ``GET /v1/models``, ``GET /health``,
``GET /metrics``. Every refusal is an OpenAI error body with a 4xx status (429/503 with
``Retry-After`` under overload), and a client that goes away mid-stream aborts its request.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from tetris.engine.request import OutputDelta, Transcript
from tetris.serve.backend import GenerationBackend, Overloaded
from tetris.serve.metrics import CONTENT_TYPE, ServingMetrics
from tetris.serve.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ProtocolError,
    error_body,
    sse,
    to_sampling_params,
)

__all__ = ["create_api", "validate_generation"]


def _error_response(err: ProtocolError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def _validation_error(exc: RequestValidationError) -> ProtocolError:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return ProtocolError(f"malformed JSON body: {first.get('msg', '')}".rstrip(": "))
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    return ProtocolError(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                         param=".".join(loc) or None)


class _Prepared:
    """A validated request, ready for the backend."""

    def __init__(self, gen: GenerateRequest, created: int, kind: str):
        self.gen, self.created, self.kind = gen, created, kind


def create_api(backend: GenerationBackend, *, metrics: ServingMetrics | None = None,
               default_max_tokens: int = 16, extra_metrics=None) -> FastAPI:
    """Build the FastAPI app; the Ray Serve ingress wraps it, tests call it directly.

    ``extra_metrics``: an async callable returning more Prometheus text for ``/metrics``
    (the dispatcher's scheduling metrics, which live in another process).
    """
    app = FastAPI(title="Tetris", version="0.1.0")
    metrics = metrics or ServingMetrics(backend.model_name)

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(_: Request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(ProtocolError)
    async def _on_protocol(_: Request, exc: ProtocolError):
        return _error_response(exc)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": backend.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": backend.model_name, "object": "model", "created": 0, "owned_by": "tetris",
            "max_model_len": backend.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        stats = backend.stats()
        if inspect.isawaitable(stats):
            stats = await stats
        metrics.set_load(running=stats.get("running", 0), waiting=stats.get("waiting", 0))
        for instance, usage in stats.get("kv_usage", {}).items():  # single-process backends
            metrics.set_kv_usage(instance, usage)
        if "improvement_rate" in stats:
            metrics.set_improvement_rate(stats["improvement_rate"])
        body = metrics.render()
        if extra_metrics is not None:
            body += await extra_metrics()
        return Response(body, media_type=CONTENT_TYPE)

    # The routes parse their own bodies (``_parse``): a parameter FastAPI parsed stays referenced
    # by FastAPI's frame until the response is built, and a token-id prompt parsed by pydantic
    # is one Python int per token (a 100k-token prompt: 3.2 MB of ints and an 800 kB list).
    # Only the prepared request, its ids one int32 buffer, lives through the generation.
    @app.post("/v1/completions", openapi_extra=_body_ref(CompletionRequest))
    async def completions(request: Request):
        req = _parse(CompletionRequest, await request.body())
        prepared = _prepare(backend, req, _completion_prompt(backend, req), "text_completion",
                            default_max_tokens)
        del req
        return await _respond(backend, metrics, prepared)

    @app.post("/v1/chat/completions", openapi_extra=_body_ref(ChatCompletionRequest))
    async def chat(request: Request):
        req = _parse(ChatCompletionRequest, await request.body())
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            text = backend.tokenizer.apply_chat_template(messages)
        except ValueError as e:
            raise ProtocolError(str(e), param="messages") from None
        prompt = backend.tokenizer.encode(text, add_bos=True)
        prepared = _prepare(backend, req, prompt, "chat.completion", default_max_tokens)
        del req, messages, text, prompt
        return await _respond(backend, metrics, prepared)

    _document_bodies(app, (CompletionRequest, ChatCompletionRequest))
    return app


def _parse(model: type[BaseModel], body: bytes):
    """Validate a JSON body as FastAPI would, its errors reported the same way (a 400)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False), body=None) from None


def _body_ref(model: type[BaseModel]) -> dict:
    """The route's JSON body in the OpenAPI document: the routes read the raw body themselves,
    so FastAPI does not know it (``_document_bodies`` adds the schemas)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _document_bodies(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add ``models`` (and the models they use) to the OpenAPI document's schemas."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = generate()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
        return app.openapi_schema

    app.openapi = openapi


def _completion_prompt(backend: GenerationBackend, req: CompletionRequest) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise ProtocolError("batched prompts are not supported; send one prompt per request",
                                param="prompt")
        p = p[0]
    if isinstance(p, str):
        return backend.tokenizer.encode(p, add_bos=True) if p else []
    return list(p)


def _prepare(backend: GenerationBackend, req, prompt: list[int], kind: str,
             default_max_tokens: int) -> _Prepared:
    if req.model != backend.model_name:
        raise ProtocolError(f"model {req.model!r} does not exist; this server serves "
                            f"{backend.model_name!r}", status=404, param="model",
                            code="model_not_found")
    default = min(default_max_tokens, max(1, backend.max_model_len - len(prompt)))
    sampling = to_sampling_params(req, default_max_tokens=default)
    validate_generation(backend, prompt, sampling)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    try:
        gen = GenerateRequest(request_id=f"{prefix}-{uuid.uuid4().hex}",
                              prompt_token_ids=prompt, sampling=sampling, stream=req.stream,
                              include_usage=include_usage, arrival_time=time.monotonic())
    except ValueError as e:   # an id past int32 cannot even travel (tetris/token_ids.py)
        raise ProtocolError(f"prompt: {e}", param="prompt") from None
    return _Prepared(gen, int(time.time()), kind)


def validate_generation(backend: GenerationBackend, prompt: list[int], sampling) -> None:
    """Refuse a prompt or ``max_tokens`` the model can never serve (``ProtocolError``, a 400;
    the handle API re-raises it as ``ValueError``)."""
    if not prompt:
        raise ProtocolError("prompt is empty: at least one token is needed", param="prompt")
    limit = backend.max_model_len
    if len(prompt) >= limit:
        raise ProtocolError(f"this model's maximum context length is {limit} tokens, but the "
                            f"prompt has {len(prompt)} tokens", param="prompt",
                            code="context_length_exceeded")
    if len(prompt) + sampling.max_tokens > limit:
        raise ProtocolError(f"max_tokens is too large: this model's maximum context length is "
                            f"{limit} tokens and the prompt has {len(prompt)}, so at most "
                            f"{limit - len(prompt)} tokens can be generated", param="max_tokens")


async def _start(backend: GenerationBackend, prepared: _Prepared):
    """Start generation and wait for the first output, so refusals still get a 4xx status."""
    stream = backend.generate(prepared.gen)
    try:
        first = await anext(stream)
    except Overloaded as e:
        await stream.aclose()
        raise ProtocolError(f"server overloaded: {e}", status=429, type="rate_limit_error",
                            headers={"Retry-After": str(max(1, round(e.retry_after_s)))}) from None
    except ValueError as e:
        await stream.aclose()
        raise ProtocolError(str(e)) from None
    return stream, first


async def _respond(backend, metrics: ServingMetrics, prepared: _Prepared):
    stream, first = await _start(backend, prepared)
    tracker = _Tracker(metrics, prepared.gen)
    tracker.on_output(first)
    if prepared.gen.stream:
        return StreamingResponse(_sse_events(stream, first, prepared, backend, tracker),
                                 media_type="text/event-stream")
    whole = Transcript()
    whole.add(first)
    try:
        if not first.finished:
            async for out in stream:
                tracker.on_output(out)
                whole.add(out)
    finally:
        await stream.aclose()
    return _full_body(prepared, backend.model_name, whole)


class _Tracker:
    """Records TTFT, inter-token gaps and end-to-end latency of one request."""

    def __init__(self, metrics: ServingMetrics, gen: GenerateRequest):
        self.metrics, self.gen = metrics, gen
        self.last: float | None = None

    def on_output(self, out: OutputDelta) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            if self.last is None:
                self.metrics.observe_first_token(now - self.gen.arrival_time, None,
                                                 len(self.gen.prompt_token_ids))
            else:
                self.metrics.observe_token_gap(now - self.last)
            self.last = now
        if out.finished:
            self.metrics.observe_finish(now - self.gen.arrival_time, out.num_tokens,
                                        out.finish_reason or "stop")


def _usage(prepared: _Prepared, completion_tokens: int) -> dict:
    p = len(prepared.gen.prompt_token_ids)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens,
            "total_tokens": p + completion_tokens}


def _full_body(prepared: _Prepared, model: str, out: Transcript) -> dict:
    if prepared.kind == "chat.completion":
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": None, "finish_reason": out.finish_reason}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None,
                  "finish_reason": out.finish_reason}
    return {"id": prepared.gen.request_id, "object": prepared.kind, "created": prepared.created,
            "model": model, "choices": [choice], "usage": _usage(prepared, len(out.token_ids))}


def _chunk(prepared: _Prepared, model: str, out: OutputDelta | None, *, first: bool) -> dict:
    finish = out.finish_reason if out is not None and out.finished else None
    text = out.new_text if out is not None else ""
    if prepared.kind == "chat.completion":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": prepared.gen.request_id, "object": kind, "created": prepared.created,
            "model": model, "choices": [choice]}


async def _sse_events(stream: AsyncIterator[OutputDelta], first: OutputDelta,
                      prepared: _Prepared, backend, tracker: _Tracker):
    """SSE frames; leaving early (client gone) closes ``stream``, which aborts the request."""
    model = backend.model_name
    last = first
    try:
        yield sse(_chunk(prepared, model, first, first=True))
        if not first.finished:
            async for out in stream:
                tracker.on_output(out)
                last = out
                if out.new_text or out.finished:
                    yield sse(_chunk(prepared, model, out, first=False))
        if prepared.gen.include_usage:
            yield sse({"id": prepared.gen.request_id, "object": _chunk(prepared, model, None,
                       first=False)["object"], "created": prepared.created, "model": model,
                       "choices": [], "usage": _usage(prepared, last.num_tokens)})
        yield SSE_DONE
    finally:
        await stream.aclose()
