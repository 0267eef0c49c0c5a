"""The ingress deployment: the OpenAI HTTP API, the admin routes and the Python handle API.

It owns nothing but that surface: it tokenizes and validates (``tetris.serve.api``), calls
the dispatcher's ``generate`` and streams what comes back; a refusal the dispatcher raised
comes back as the same ``Overloaded`` or ``ValueError`` (``remote_errors.as_client_error``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from ray import serve

from tetris.config import DeploymentConfig
from tetris.engine.request import Transcript
from tetris.model.loader import load_tokenizer_for, resolve_model_config
from tetris.serve.fields import cluster_unsupported
from tetris.serve.handles import DecodeHandleClient
from tetris.serve.pools import NO_CPU
from tetris.serve.protocol import GenerateRequest
from tetris.serve.relay import RelayReport, follow
from tetris.serve.remote_errors import as_client_error
from tetris.serve.types import Generation, GenerationDelta, GenerationRequest
from tetris.token_ids import compact_tokens

__all__ = ["Ingress", "DispatcherBackend"]


class DispatcherBackend:
    """``GenerationBackend`` over the dispatcher's handle (what the OpenAI API calls)."""

    def __init__(self, deployment: DeploymentConfig, handle, decode=None) -> None:
        self.handle = handle
        # the decode pool's handle: its outputs stream from there to here in one hop
        self.decode = None if decode is None else DecodeHandleClient(decode, [])
        self.model_name = deployment.model.name
        resolved = resolve_model_config(deployment.model)
        self.max_model_len = resolved.max_position_embeddings
        self._tokenizer = load_tokenizer_for(resolved)
        # what the cluster refuses with a 400 naming the field (api.validate_generation)
        self.unsupported = cluster_unsupported(deployment)
        self._stats: dict = {}

    @property
    def tokenizer(self):
        return self._tokenizer

    async def generate(self, req: GenerateRequest) -> AsyncIterator:
        gen = self.handle.options(stream=True).generate.remote(req)
        try:
            if self.decode is None:
                async for out in gen:
                    yield out
            else:
                async with contextlib.aclosing(follow(gen, self.decode.stream, self._report)) as outs:
                    async for out in outs:
                        yield out
        except Exception as e:
            raise as_client_error(e) from None
        finally:
            gen.cancel()

    async def _report(self, run_id: str, report: RelayReport) -> None:
        await self.handle.relay_report.remote(run_id, report)

    async def stats(self) -> dict:
        return await self.handle.stats.remote()


@serve.deployment(ray_actor_options=NO_CPU, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    """HTTP (OpenAI API + admin routes) and the Python handle API."""

    def __init__(self, deployment: DeploymentConfig, dispatcher, decode=None) -> None:
        from tetris.serve.metrics import ServingMetrics

        self.deployment = deployment
        self.dispatcher = dispatcher
        self.backend = DispatcherBackend(deployment, dispatcher, decode)
        self.decode_pool = decode   # KunServe's admin routes call it
        self.metrics = ServingMetrics(deployment.model.name, scheduler=False)

    def __serve_build_asgi_app__(self):
        from tetris.serve.admin import add_admin_routes
        from tetris.serve.api import create_api

        app = create_api(self.backend, metrics=self.metrics,
                         extra_metrics=lambda: self.dispatcher.metrics_text.remote())
        add_admin_routes(app, self.dispatcher)
        if self.deployment.kunserve.enabled and self.decode_pool is not None:
            from tetris.serve.kunserve_served import add_kunserve_served_routes

            add_kunserve_served_routes(app, self.decode_pool)
        return app

    # -- Python handle API ------------------------------------------------------------------
    def _to_generate(self, request: GenerationRequest) -> GenerateRequest:
        import time

        from tetris.serve.api import validate_generation
        from tetris.serve.protocol import ProtocolError

        if request.prompt is not None:
            ids = self.backend.tokenizer.encode(request.prompt, add_bos=True) if request.prompt else []
        else:
            ids = request.prompt_token_ids
        # The edge: from here on the prompt is one int32 buffer (tetris/token_ids.py).
        ids = compact_tokens(ids)
        try:
            validate_generation(self.backend, ids, request.sampling)
        except ProtocolError as e:
            raise ValueError(e.message) from None
        return GenerateRequest(request_id=request.request_id or f"handle-{uuid.uuid4().hex}",
                               prompt_token_ids=ids, sampling=request.sampling,
                               stream=True, arrival_time=time.monotonic())

    async def generate(self, request: GenerationRequest) -> Generation:
        req = self._to_generate(request)
        whole = Transcript()
        async for out in self.backend.generate(req):
            whole.add(out)
        return Generation(request_id=req.request_id, text=whole.text, token_ids=tuple(whole.token_ids),
                          prompt_tokens=len(req.prompt_token_ids), finish_reason=whole.finish_reason,
                          logprobs=tuple(whole.logprobs))

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        req = self._to_generate(request)
        async for out in self.backend.generate(req):
            yield GenerationDelta(request_id=req.request_id, new_text=out.new_text,
                                  new_token_ids=out.new_token_ids, finished=out.finished,
                                  finish_reason=out.finish_reason,
                                  new_logprobs=out.new_logprobs)
