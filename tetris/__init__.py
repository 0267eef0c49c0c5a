"""Tetris: long-context LLM serving with chunkwise dynamic sequence parallelism (CDSP).

Subpackages: ``tetris.model`` (Llama in torch), ``tetris.engine`` (single-instance engine,
paged KV cache, sampling), ``tetris.scheduler`` (latency models, CDSP and baseline policies),
``tetris.sim`` (discrete-event simulator), ``tetris.actors`` (Ray actors), ``tetris.transfer``
(KV streaming), ``tetris.kernels`` (attention kernels), ``tetris.bench`` (the benchmarks of
``tetris bench``), ``tetris.cli`` (the ``tetris`` command).
"""

__version__ = "0.1.0"
