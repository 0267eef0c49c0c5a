"""Errors that say what the caller can do about a failure, shared by every layer.

``InstanceLost`` marks a request that failed because a worker died under it (a prefill
worker, a decode TP rank), not because of anything in the request: what it had computed is
gone, but the request can be run again on the instances still (or again) up. The pools raise
subclasses of their own error types that are also ``InstanceLost`` (``PrefillWorkerLost``,
``DecodeInstanceLost``); the dispatcher runs such a request again and resumes the client's
stream where it stopped (``tetris.serve.dispatcher``).

Two errors concern a plan, not a request, when a prefill worker is being replaced:
``InstanceReplacing`` refuses a plan at commit (the planner did not know yet; it plans again
around the instance before anything ran), and ``PlanOutdated`` (an ``InstanceLost``) loses a
run whose plan was committed before the worker was found dead and reaches it only now: nothing
the request computed on the dead worker is lost, so the run again is not charged against the
request's retries.
"""

from __future__ import annotations

__all__ = ["ConfigError", "InstanceLost", "InstanceReplacing", "PlanOutdated", "PrefixMissing"]


class InstanceLost(RuntimeError):
    """A worker serving the request died; the request itself was fine and may be retried."""


class PlanOutdated(InstanceLost):
    """The run's plan was made before one of its instances' worker was found dead and its
    chunk there had not started: plan the request again (it lost no work on that worker)."""


class PrefixMissing(PlanOutdated):
    """The run's plan read a cached prefix (prefix caching) whose KV is no longer whole where
    the index said (its worker was replaced, say): forget ``source`` and plan the request
    again; nothing was computed yet."""

    def __init__(self, message: str, source: str = "") -> None:
        super().__init__(message)
        self.source = source

    def __reduce__(self):   # keeps ``source`` across processes
        return (type(self), (str(self), self.source))


class InstanceReplacing(RuntimeError):
    """A plan was refused at commit: it uses instances whose workers are being replaced."""

    def __init__(self, message: str, instances: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.instances = tuple(instances)

    def __reduce__(self):   # keeps ``instances`` across processes
        return (type(self), (str(self), self.instances))


class ConfigError(ValueError):
    """A config file or value is invalid; the message says where and what was expected."""
