"""Environment of every process Tetris starts (Serve replicas, prefill workers, decode ranks).

``MALLOC_ARENA_MAX=2``: glibc gives each thread that allocates its own malloc arena (up to 8 per
core), and memory freed into one arena is not reused by another thread. A Ray actor runs
several threads that allocate (Ray's core worker, the transfer pump, asyncio), so its RSS
crept up with every call: in a 10-minute soak the token-path actors grew by 25-33%
(docs/soak.md). A two-actor reproduction (fire-and-forget calls from a thread, ~900/s) grew
the caller by ~250 B per call with glibc's default and stayed flat with two arenas. A value
already set in the environment that starts Tetris wins.

The control processes (the Serve replicas: ingress, dispatcher, pool servers) also start with
``MALLOC_MMAP_THRESHOLD_=65536``. They compute nothing; what they allocate big is per request:
a prompt arriving as a tuple of ints (a 24k-token prompt is a 190 kB tuple), its int32 copy,
serialized messages. glibc serves a block past the mmap threshold with its own mapping,
unmapped on free, but after the first such free it raises the threshold (up to 32 MB), so from
then on those blocks come from the heap, where a burst of them leaves holes that small
long-lived objects pin. In a soak the ingress then held 11 MiB more freed-but-kept heap at the
end than at warm-up (``tetris bench soak``'s heap report: malloc in use -4.5 MiB, free +11 MiB;
docs/soak.md). Setting the threshold fixes it (and turns off the dynamic raise). Not for the
prefill workers and decode ranks: there torch allocates activation buffers past 64 kB every
step, and a mapping per buffer would cost page faults on the hot path.

The control processes also get ``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000``: Ray Serve caches
its request metrics and flushes them from a task in every replica and every handle's router
that wakes every 100 ms by default, idle or not (~0.2% of a core per replica on the 2-core
test machine); Ray only exports metrics every 10 s anyway. ``tetris serve`` sets the same default
in its own environment before it starts Ray, for its handle and Serve's own actors.

glibc reads the variables when the process starts, so they have to be in the runtime env Ray
starts the actor with; setting ``os.environ`` inside the actor would be too late.
"""

from __future__ import annotations

import os

__all__ = ["PROCESS_ENV_VARS", "CONTROL_ENV_VARS", "SERVE_ENV_VARS", "runtime_env"]

PROCESS_ENV_VARS = {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}
# Ray Serve's metrics flush period (ms) in the control processes (module docstring)
SERVE_ENV_VARS = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS":
                  os.environ.get("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "1000")}
CONTROL_ENV_VARS = PROCESS_ENV_VARS | SERVE_ENV_VARS | {
    "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "65536")}


def runtime_env(*, control: bool = False) -> dict:
    """``runtime_env`` for ``ActorClass.options`` / Serve's ``ray_actor_options``; ``control``
    for processes that only route and hold requests (module docstring)."""
    return {"env_vars": dict(CONTROL_ENV_VARS if control else PROCESS_ENV_VARS)}
