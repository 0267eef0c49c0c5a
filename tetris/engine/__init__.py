"""Single-instance engine: paged KV cache, block manager, sampling, continuous batching.

``LLMEngine`` lives in ``tetris.engine.engine``; ``tetris.engine.request`` holds per-request
state, the ``RequestOutput`` a step returns and the ``OutputDelta`` every serving hop streams, and imports no torch, so the serving layer can
use the output types without loading the model stack. Nothing is imported here for the same
reason.
"""
