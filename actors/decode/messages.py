"""Messages between a decode instance's driver and its TP rank actors (msgspec Structs).

Every round the driver sends the same ``Command`` list to every rank; each rank applies it to
its own ``LLMEngine`` replica, runs one engine step and answers with a ``StepReply``. Because
all replicas see the same commands in the same order, their batching decisions, block tables
and sampled tokens stay identical (lockstep), and the model's collectives keep them in step.
"""

from __future__ import annotations

import msgspec

from tetris.engine.engine import EngineStats
from tetris.engine.request import OutputDelta, TokenLogprob
from tetris.errors import InstanceLost
from tetris.sampling_params import SamplingParams
from tetris.token_ids import TokenIds

__all__ = ["Reserve", "Commit", "Add", "Abort", "Command", "Rejected", "Failed", "FirstTokenArrived", "StepReply",
           "RankHeld", "DecodeFull", "DecodeError", "DecodeInstanceLost", "KVTransferFailed",
           "HolderLost"]


class Reserve(msgspec.Struct, frozen=True, tag="reserve"):
    """Hold KV blocks for a prompt prefilled elsewhere and open its transfer on this rank."""

    request_id: str
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    # output tokens the client already has (a request resumed after its instance was lost):
    # their KV comes with the prompt's (``LLMEngine.reserve``)
    generated: tuple[int, ...] = ()
    # elastic decode (actors/decode/elastic.py): this instance masters the request and holds
    # only positions [kv_start, n); the KV arrives in range-local positions
    kv_start: int = 0
    # prefix caching's decode side (engine/kept_kv.py): keep the KV once finished (``keep``);
    # positions [0, prefix_tokens) are read from the kept run ``prefix_from`` (its full blocks
    # shared, the boundary block copied) and not streamed
    keep: bool = False
    prefix_from: str = ""
    prefix_tokens: int = 0


class Commit(msgspec.Struct, frozen=True, tag="commit"):
    """Every rank has the prompt's KV and the prefill sampled ``first_token``: start decoding.
    ``first_logprob``: its logprobs, when the request asked for them."""

    request_id: str
    first_token: int
    first_logprob: TokenLogprob | None = None


class Add(msgspec.Struct, frozen=True, tag="add"):
    """Prefill on the decode instance itself (tests, and a fallback without a prefill pool)."""

    request_id: str
    prompt_token_ids: TokenIds
    sampling: SamplingParams


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    """Stop the request and free its blocks and receive-side state (idempotent)."""

    request_id: str
    reason: str = "aborted"


Command = Reserve | Commit | Add | Abort


class Rejected(msgspec.Struct, frozen=True):
    """A command that could not be applied. ``full``: no KV room now (retry later), as opposed
    to input the engine can never serve."""

    request_id: str
    reason: str
    full: bool = False


class Failed(msgspec.Struct, frozen=True):
    """The request's KV transfer failed on this rank (timeout, sender abort, ...)."""

    request_id: str
    reason: str
    # elastic decode: a decoding request lost an instance holding part of its KV (resume it)
    holder_lost: bool = False


class FirstTokenArrived(msgspec.Struct, frozen=True):
    """The request's first token reached this rank with its KV (the prefill member that
    sampled it sent it over the transfer): the driver commits without the dispatcher's."""

    request_id: str
    token: int
    logprob: TokenLogprob | None = None


class StepReply(msgspec.Struct, frozen=True):
    """One rank's answer to one round.

    ``outputs`` come from rank 0 only (the others would repeat them). ``ready`` and ``failed``
    are this rank's transfer events since its previous reply.
    """

    rank: int
    outputs: list[OutputDelta]
    ready: list[str]
    failed: list[Failed]
    rejected: list[Rejected]
    stats: EngineStats
    step_s: float = 0.0     # this rank's engine.step() time this round (0 without a model call)
    first_tokens: list[FirstTokenArrived] = []   # this rank's since its previous reply


class RankHeld(msgspec.Struct, frozen=True):
    """What one rank still holds: empty lists and all blocks free once every request is gone."""

    engine_requests: int   # unfinished sequences of the engine, receiving ones included
    receiving: list[str]   # requests the receive manager still waits on
    backends_held: list[int]
    free_blocks: int
    total_blocks: int
    kept: list[str] = []   # finished runs whose KV is kept for a later prefix (kept_kv.py)

    @property
    def empty(self) -> bool:
        return (self.engine_requests == 0 and not self.receiving and not self.backends_held
                and self.free_blocks == self.total_blocks)


class DecodeFull(Exception):
    """The decode instance has no KV room for this prompt now; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 0.5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DecodeError(Exception):
    """A request failed on the decode instance (e.g. its KV transfer); it holds nothing now."""


class KVTransferFailed(DecodeError, InstanceLost):
    """The request's KV did not arrive (a sender died, or the transfer timed out): nothing was
    wrong with the request, and a prefill run again sends its KV anew."""


class HolderLost(DecodeError, InstanceLost):
    """Elastic decode: an instance holding part of the request's KV was lost under it; the
    request was fine and can be run again (actors/decode/elastic.py)."""


class DecodeInstanceLost(DecodeError, InstanceLost):
    """The decode instance broke (a TP rank died, or it shut down) under the request: the
    request was fine and can be run again on an instance that is up."""
