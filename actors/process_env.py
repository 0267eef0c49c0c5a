"""Environment of every process Tetris starts (Serve replicas, prefill workers, decode ranks).

``MALLOC_ARENA_MAX=2``: glibc gives each thread that allocates its own malloc arena (up to 8 per
core), and memory freed into one arena is not reused by another thread. A Ray actor runs
several threads that allocate (Ray's core worker, the transfer pump, asyncio), so its RSS
crept up with every call: in a 10-minute soak the token-path actors grew by 25-33%
(docs/soak.md). A two-actor reproduction (fire-and-forget calls from a thread, ~900/s) grew
the caller by ~250 B per call with glibc's default and stayed flat with two arenas. A value
already set in the environment that starts Tetris wins.

glibc reads the variable when the process starts, so it has to be in the runtime env Ray starts
the actor with; setting ``os.environ`` inside the actor would be too late.
"""

from __future__ import annotations

import os

__all__ = ["PROCESS_ENV_VARS", "runtime_env"]

PROCESS_ENV_VARS = {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}


def runtime_env() -> dict:
    """``runtime_env`` for ``ActorClass.options`` / Serve's ``ray_actor_options``."""
    return {"env_vars": dict(PROCESS_ENV_VARS)}
