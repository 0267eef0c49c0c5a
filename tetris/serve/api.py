"""The OpenAI-compatible HTTP API over any ``GenerationBackend``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming,
``stream_options`` and usage counts), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
A request is one or more choices (``n``, a list of prompts), each its own generation on the
backend, run concurrently (``tetris.serve.fanout``) and rendered by ``tetris.serve.responses``.
Every refusal is an OpenAI error body with a 4xx status (429/503 with ``Retry-After`` under
overload), an unknown or unsupported field included (``tetris.serve.fields``), and a client
that goes away mid-stream aborts its request's generations.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import uuid

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from tetris.engine.request import OutputDelta, Transcript
from tetris.serve.backend import GenerationBackend, Overloaded
from tetris.serve.fanout import merged, start_all
from tetris.serve.fields import check_backend, prompt_only, refusal_for_extra, sampling_params
from tetris.serve.logprobs_format import TokenText
from tetris.serve.metrics import CONTENT_TYPE, ServingMetrics
from tetris.serve.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ProtocolError,
    error_body,
    sse,
)
from tetris.serve.responses import Choice, ChoiceView, Prepared, usage

__all__ = ["create_api", "validate_generation"]


def _error_response(err: ProtocolError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def _validation_error(exc: RequestValidationError) -> ProtocolError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ProtocolError(f"malformed JSON body: {first.get('msg', '')}".rstrip(": "))
    # A field the models do not take is the most useful thing to name.
    extra = next((e for e in errors if e.get("type") == "extra_forbidden"), None)
    if extra is not None:
        loc = [str(x) for x in extra.get("loc", ()) if x != "body"]
        err = refusal_for_extra(loc[-1] if loc else "body")
        if len(loc) > 1:   # inside a message or stream_options: name the path
            err.param = ".".join(loc)
        return err
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    return ProtocolError(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                         param=".".join(loc) or None)


def create_api(backend: GenerationBackend, *, metrics: ServingMetrics | None = None,
               default_max_tokens: int = 16, extra_metrics=None) -> FastAPI:
    """Build the FastAPI app; the Ray Serve ingress wraps it, tests call it directly.

    ``extra_metrics``: an async callable returning more Prometheus text for ``/metrics``
    (the dispatcher's scheduling metrics, which live in another process).
    """
    app = FastAPI(title="Tetris", version="0.1.0")
    metrics = metrics or ServingMetrics(backend.model_name)
    text_of = TokenText(backend.tokenizer)

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
        for instance, kv in stats.get("kv_usage", {}).items():  # single-process backends
            metrics.set_kv_usage(instance, kv)
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
        prepared = _prepare(backend, req, _completion_prompts(backend, req), "text_completion",
                            default_max_tokens)
        del req
        return await _respond(backend, metrics, prepared, text_of)

    @app.post("/v1/chat/completions", openapi_extra=_body_ref(ChatCompletionRequest))
    async def chat(request: Request):
        req = _parse(ChatCompletionRequest, await request.body())
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            text = backend.tokenizer.apply_chat_template(messages)
        except ValueError as e:
            raise ProtocolError(str(e), param="messages") from None
        prompt = backend.tokenizer.encode(text, add_bos=True)
        prepared = _prepare(backend, req, [(prompt, None)], "chat.completion",
                            default_max_tokens)
        del req, messages, text, prompt
        return await _respond(backend, metrics, prepared, text_of)

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


def _completion_prompts(backend: GenerationBackend,
                        req: CompletionRequest) -> list[tuple[list[int], str | None]]:
    """(token ids, text to echo) of each prompt: a string, token ids, or a list of either.
    The text is kept only for an echo (a string prompt echoes as sent, ids as decoded)."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise ProtocolError("prompt is empty: at least one token is needed", param="prompt")
    out = []
    for one in p:
        if isinstance(one, str):
            ids = backend.tokenizer.encode(one, add_bos=True) if one else []
            out.append((ids, one if req.echo else None))
        else:
            out.append((one, backend.tokenizer.decode(list(one)) if req.echo else None))
    return out


def _prepare(backend: GenerationBackend, req, prompts: list[tuple[list[int], str | None]],
             kind: str, default_max_tokens: int) -> Prepared:
    if req.model != backend.model_name:
        raise ProtocolError(f"model {req.model!r} does not exist; this server serves "
                            f"{backend.model_name!r}", status=404, param="model",
                            code="model_not_found")
    n = req.n or 1
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    choices, sampling = [], None
    for p, (ids, prompt_text) in enumerate(prompts):
        default = min(default_max_tokens, max(1, backend.max_model_len - len(ids)))
        sampling = sampling_params(req, default_max_tokens=default)
        validate_generation(backend, ids, sampling)
        for j in range(n):
            # seed + j per choice, as vLLM does: n samples, not n copies of one
            s = sampling if sampling.seed is None or j == 0 else msgspec.structs.replace(
                sampling, seed=sampling.seed + j)
            index = p * n + j
            rid = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
            try:
                gen = GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=s,
                                      stream=bool(req.stream), include_usage=include_usage,
                                      arrival_time=time.monotonic())
            except ValueError as e:   # an id past int32 cannot even travel (tetris/token_ids.py)
                raise ProtocolError(f"prompt: {e}", param="prompt") from None
            choices.append(Choice(index, p, gen, prompt_text))
    _check_fanout(len(choices))
    return Prepared(request_id=request_id, kind=kind, created=int(time.time()), choices=choices,
                    prompt_tokens=[len(ids) for ids, _ in prompts], stream=bool(req.stream),
                    include_usage=include_usage,
                    continuous_usage=bool(opts and opts.continuous_usage_stats),
                    logprobs=sampling.logprobs, echo=bool(getattr(req, "echo", False)),
                    prompt_only=prompt_only(req))


def _check_fanout(choices: int) -> None:
    from tetris.serve.fields import MAX_N

    if choices > MAX_N:
        raise ProtocolError(f"{choices} choices (prompts x n) in one request; at most {MAX_N}",
                            param="n")


def validate_generation(backend: GenerationBackend, prompt, sampling) -> None:
    """Refuse a prompt or ``max_tokens`` the model can never serve, or what this backend does
    not (``ProtocolError``, a 400; the handle API re-raises it as ``ValueError``)."""
    if not len(prompt):
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
    check_backend(sampling, getattr(backend, "unsupported", {}))


async def _start(backend: GenerationBackend, gen: GenerateRequest):
    """Start generation and wait for the first output, so refusals still get a 4xx status."""
    stream = backend.generate(gen)
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


async def _respond(backend, metrics: ServingMetrics, prepared: Prepared, text_of: TokenText):
    started = await start_all([lambda c=c: _start(backend, c.gen) for c in prepared.choices])
    trackers = [_Tracker(metrics, c.gen) for c in prepared.choices]
    for tracker, (_, first) in zip(trackers, started):
        tracker.on_output(first)
    views = [ChoiceView(prepared, c, text_of) for c in prepared.choices]
    if prepared.stream:
        return StreamingResponse(_sse_events(started, prepared, backend.model_name, views,
                                             trackers), media_type="text/event-stream")
    wholes = [Transcript() for _ in prepared.choices]
    try:
        async with contextlib.aclosing(merged(started)) as outputs:
            async for k, (i, out) in enumerate_async(outputs):
                if k >= len(started):   # the first outputs were tracked at the start
                    trackers[i].on_output(out)
                wholes[i].add(out)
                views[i].note(out)
    finally:
        for stream, _ in started:
            await stream.aclose()
    choices = [view.full(whole) for view, whole in zip(views, wholes)]
    return {"id": prepared.request_id, "object": prepared.kind, "created": prepared.created,
            "model": backend.model_name, "choices": choices,
            "usage": _total_usage(prepared, views)}


def _total_usage(prepared: Prepared, views: list[ChoiceView]) -> dict:
    return usage(sum(prepared.prompt_tokens), sum(v.completion_tokens for v in views),
                 sum(v.cached_tokens for v in views))


async def enumerate_async(items):
    k = 0
    async for item in items:
        yield k, item
        k += 1


class _Tracker:
    """Records TTFT, inter-token gaps and end-to-end latency of one generation."""

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


async def _sse_events(started, prepared: Prepared, model: str, views: list[ChoiceView],
                      trackers: list[_Tracker]):
    """SSE frames; leaving early (client gone) closes every stream, which aborts the request."""
    head = {"id": prepared.request_id, "object": prepared.chunk_object,
            "created": prepared.created, "model": model}
    try:
        async with contextlib.aclosing(merged(started)) as outputs:
            async for k, (i, out) in enumerate_async(outputs):
                if k >= len(started):
                    trackers[i].on_output(out)
                choice = views[i].chunk(out)
                if choice is None:
                    continue
                chunk = head | {"choices": [choice]}
                if prepared.continuous_usage:
                    chunk["usage"] = views[i].usage
                yield sse(chunk)
        if prepared.include_usage:
            yield sse(head | {"choices": [], "usage": _total_usage(prepared, views)})
        yield SSE_DONE
    finally:
        for stream, _ in started:
            await stream.aclose()
