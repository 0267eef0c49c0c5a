"""What the HTTP layer needs from whatever generates tokens, and the single-instance backend.

``GenerationBackend`` is the seam between the OpenAI API and execution: the full CDSP system
(dispatcher, prefill pool, KV transfer, decode instances) and the single-instance engine both
implement it, so the API, its validation, streaming and error handling are written once.

``LocalEngineBackend`` drives one ``LLMEngine`` on a dedicated thread: the engine is not
thread-safe, so every call into it (add, abort, step) runs on that one thread, and outputs are
handed to each request's asyncio queue on the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Protocol

from tetris.engine.request import OutputDelta
from tetris.serve.protocol import GenerateRequest

__all__ = ["GenerationBackend", "Overloaded", "LocalEngineBackend"]


class Overloaded(Exception):
    """The backend's bounded queue is full; the caller should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GenerationBackend(Protocol):
    """``unsupported`` (optional, default empty): ``SamplingParams`` fields this backend cannot
    serve -> (the request field to name, why); a request that sets one gets a 400
    (``tetris.serve.fields.check_backend``). Outputs carry logprobs as ``OutputDelta`` does."""

    model_name: str
    max_model_len: int

    @property
    def tokenizer(self): ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[OutputDelta]:
        """Stream output deltas until one has ``finished`` (``Transcript`` adds them up).

        Raises ``ValueError`` for input it can never serve and ``Overloaded`` when full. Closing
        the iterator early aborts the request and frees everything it held.
        """
        ...

    def stats(self) -> dict: ...


class LocalEngineBackend:
    """Serve with one in-process ``LLMEngine`` (no Ray): the reference and the smallest setup.
    It serves every sampling field, prompt logprobs included."""

    unsupported: Mapping[str, tuple[str, str]] = MappingProxyType({})

    def __init__(self, engine, model_name: str, *, max_pending: int = 256):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.max_pending = max_pending
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tetris-engine")
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._commands: list = []  # callables to run on the engine thread, in order
        self._loop_future = self._thread.submit(self._run)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail every live request, keep the thread
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _drain_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for fn in commands:
            fn()

    def _submit(self, fn) -> None:
        with self._lock:
            self._commands = [*self._commands, fn]
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        entry = self._queues.get(request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, err: Exception) -> None:
        for request_id in list(self._queues):
            self.engine.abort_request(request_id)
            self._deliver(request_id, RuntimeError(f"engine step failed: {err}"))
        self.engine.step()  # collect the aborts so the engine holds nothing

    # -- event loop -----------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[OutputDelta]:
        if len(self._queues) >= self.max_pending:
            raise Overloaded(f"{len(self._queues)} requests in flight (limit {self.max_pending})")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added: asyncio.Future = loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(req.request_id, list(req.prompt_token_ids), req.sampling)
                self._queues[req.request_id] = (loop, queue)
                loop.call_soon_threadsafe(added.set_result, None)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(added.set_exception, e)

        self._submit(add)
        await added
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield OutputDelta.of(item)
                if finished:
                    return
        finally:
            self._queues.pop(req.request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort_request(req.request_id))

    def stats(self) -> dict:
        blocks = self.engine.blocks
        return {"running": len(self._queues), "waiting": 0,
                "kv_usage": {0: 1.0 - blocks.num_free_blocks / blocks.num_blocks}}

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.shutdown(wait=True)
