"""Errors that say what the caller can do about a failure, shared by every layer.

``InstanceLost`` marks a request that failed because a worker died under it (a prefill
worker, a decode TP rank), not because of anything in the request: what it had computed is
gone, but the request can be run again on the instances still (or again) up. The pools raise
subclasses of their own error types that are also ``InstanceLost`` (``PrefillWorkerLost``,
``DecodeInstanceLost``); the dispatcher runs such a request again and resumes the client's
stream where it stopped (``tetris.serve.dispatcher``).
"""

from __future__ import annotations

__all__ = ["InstanceLost"]


class InstanceLost(RuntimeError):
    """A worker serving the request died; the request itself was fine and may be retried."""
