"""Remote errors are translated by type: the original exception behind Ray's wrapper, never a
copy rebuilt from the message text (no Ray cluster needed: the wrappers are built here)."""

from __future__ import annotations

from ray.exceptions import RayTaskError

from tetris.errors import InstanceLost, InstanceReplacing, PlanOutdated
from tetris.serve.backend import Overloaded
from tetris.serve.remote_errors import as_client_error, as_lost, as_replacing, carried


def _remote(err: BaseException, hops: int = 1) -> BaseException:
    """``err`` as a caller ``hops`` processes away sees it."""
    for _ in range(hops):
        err = RayTaskError("f", "traceback", err).as_instanceof_cause()
    return err


def test_the_original_exception_comes_back_with_its_attributes():
    orig = InstanceReplacing("workers 2, 3 are being replaced", (2, 3))
    got = as_replacing(_remote(orig, hops=2))   # pool -> dispatcher deployment -> here
    assert got is orig and got.instances == (2, 3)
    full = Overloaded("no KV room", retry_after_s=3.5)
    assert as_client_error(_remote(full)) is full and full.retry_after_s == 3.5


def test_a_lost_worker_keeps_its_own_class():
    outdated, lost = PlanOutdated("worker 3 died"), InstanceLost("rank 1 died")
    assert as_lost(_remote(outdated)) is outdated
    assert as_lost(_remote(lost)) is lost
    assert as_lost(outdated) is outdated      # raised in this process


def test_an_error_of_another_type_is_left_as_it_is_even_when_its_name_says_otherwise():
    class InstanceLostLookalike(RuntimeError):   # a name is no type
        pass

    other = _remote(InstanceLostLookalike("InstanceLost in the text, too"))
    assert as_lost(other) is other
    assert carried(other, InstanceLost) is None
    bug = _remote(KeyError("x"))
    assert as_client_error(bug) is bug and as_replacing(bug) is bug
    bad = ValueError("prompt too long")
    assert as_client_error(_remote(bad)) is bad
