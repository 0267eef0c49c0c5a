"""What a pool's failure means to its caller, found by exception type.

A deployment or actor that raises ``E`` reaches its caller as Ray's ``RayTaskError(E)``: a
subclass of both ``RayTaskError`` and ``E``, whose ``cause`` is the original ``E`` (with its
own attributes: ``instances``, ``retry_after_s``). Re-raised through a second process it may
arrive as a plain ``RayTaskError`` whose ``cause`` is the first wrapper. Every translation
between the pools, the dispatcher and the ingress is one of the functions here, and each
matches by ``isinstance`` and hands on the original exception, never a copy rebuilt from the
message text.
"""

from __future__ import annotations

from typing import TypeVar

from tetris.errors import InstanceLost, InstanceReplacing
from tetris.serve.backend import Overloaded

__all__ = ["carried", "as_lost", "as_replacing", "as_client_error"]

E = TypeVar("E", bound=BaseException)


def carried(err: BaseException, cls: type[E]) -> E | None:
    """The ``cls`` exception ``err`` carries: the original behind Ray's wrappers (each one's
    ``cause``; a wrapper of a wrapper is a plain ``RayTaskError``), or ``err`` itself when it
    was raised here; None when there is no ``cls`` in the chain."""
    found = None
    for _ in range(8):
        if isinstance(err, cls):
            found = err
        cause = getattr(err, "cause", None)
        if not isinstance(cause, BaseException) or cause is err:
            break
        err = cause
    return found


def as_lost(err: BaseException) -> BaseException:
    """A lost worker (an ``InstanceLost``, ``PlanOutdated`` included: the dispatcher runs the
    request again), else ``err`` itself."""
    return carried(err, InstanceLost) or err


def as_replacing(err: BaseException) -> BaseException:
    """A plan refused for instances being replaced (the dispatcher plans again), else ``err``."""
    return carried(err, InstanceReplacing) or err


def as_client_error(err: BaseException) -> BaseException:
    """What the API maps to a 4xx: ``Overloaded`` (429/503) or ``ValueError`` (400), else
    ``err`` itself (a 500)."""
    for cls in (Overloaded, ValueError):
        found = carried(err, cls)
        if found is not None:
            return found
    return err
