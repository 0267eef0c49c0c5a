"""The SP prefill pool: the driver (``pool``, ``chunks``, ``worlds``, ``wiring``), the worker
actors and what they run (rings, cache balancing, KV store, executors)."""
