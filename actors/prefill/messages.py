"""Messages between the prefill pool (driver side) and its worker actors.

Lifecycle of one request on the pool:

1. The pool validates the ``PrefillPlan`` and derives, per chunk, the KV layout: which absolute
   positions each member holds before and after cache balancing (``Move``), and each member's
   zigzag share of the chunk.
2. For each chunk in order, every member of the chunk's group receives a ``ChunkTask``:
   ``prepare`` reserves KV slots (no communication, so a failure here stops the chunk cleanly),
   then ``execute`` runs balancing + ring attention layer by layer and returns a ``ChunkResult``.
3. The member holding the prompt's last token samples the first output token.
4. The request's KV stays in the workers' stores until it is handed off (``release``) or the
   request fails (``abort``), which frees it on every member.
5. With ``kv_receivers`` set, each member streams the KV it computes, layer by layer, to the
   decode ranks while the chunk runs (``SendManager`` shards, one per receiver); ``release``
   forgets the finished shards, ``abort`` cancels the unfinished ones.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from tetris.actors.prefill.zigzag import Ranges
from tetris.engine.request import TokenLogprob
from tetris.errors import InstanceLost, PlanOutdated
from tetris.sampling_params import SamplingParams
from tetris.token_ids import TokenIds

__all__ = [
    "BalanceMode",
    "Move",
    "ChunkTask",
    "ChunkResult",
    "PrefillResult",
    "PrefillError",
    "PrefillWorkerLost",
    "PrefillPlanOutdated",
    "first_line",
]

# "overlap": layer i+1's moves run during layer i's MLP (paper Fig. 6-b);
# "blocking": each layer's moves are waited for right after they are issued;
# "off": history stays where it is (correct, but attention to history is unbalanced).
BalanceMode = Literal["overlap", "blocking", "off"]


class PrefillError(RuntimeError):
    """A request's prefill failed; its KV has been freed on every member that held any."""


class PrefillWorkerLost(PrefillError, InstanceLost):
    """A prefill worker died during the request's chunk (it has been replaced): the request
    was fine and can be planned again."""


class PrefillPlanOutdated(PrefillWorkerLost, PlanOutdated):
    """A chunk's member instance is being replaced and the plan was committed before its
    worker was found dead: lost before it started there, the request is planned again."""


class Move(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Cache balancing: ``src`` sends the KV of ``positions`` (every layer) to ``dst``."""

    src: int
    dst: int
    positions: Ranges


class KVRange(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Elastic decode: prompt positions ``[start, end)`` stream to ``receivers`` (one decode
    instance's TP ranks) as transfer ``transfer_id``, in range-local positions
    (actors/prefill/range_stream.py)."""

    start: int
    end: int
    transfer_id: str
    receivers: tuple[int, ...]


class ChunkTask(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One member's share of one chunk. Instances are world ranks of the pool."""

    request_id: str
    chunk_index: int
    num_chunks: int
    seq: int                      # pool-wide chunk sequence number; keeps message tags distinct
    group: tuple[int, ...]        # ring order
    rank: int                     # this member's index in ``group``
    chunk_start: int
    chunk_end: int
    prompt_tokens: int
    chunk_positions: tuple[Ranges, ...]   # per ring member: its zigzag share of the chunk
    history: tuple[Ranges, ...]           # per ring member: history it holds after balancing
    moves: tuple[Move, ...] = ()
    # this member's tokens in position order: an int32 array('i') (tetris/token_ids.py), empty
    # when the executor is emulated; never msgspec-encoded (tasks travel pickled, by Ray)
    token_ids: TokenIds = msgspec.field(default_factory=lambda: TokenIds("i"))
    balance: BalanceMode = "overlap"
    sampling: SamplingParams | None = None
    return_logits: bool = False
    timeout_s: float = 60.0
    # Receiver ids (decode_instance * decode_tp + tp_rank) in TP-rank order: this member streams
    # the KV it computes, receiver j taking KV heads [j*h, (j+1)*h), h = Hkv // len. Empty: none.
    kv_receivers: tuple[int, ...] = ()
    world: int = 0                # the generation of the pool's world its rings use (world.py)
    sp_layout: str = "ring"       # the chunk's attention across the group (tetris/plan.py)
    sp_micro_partitions: int = 1  # "a2a": three-phase pipelining (alltoall_pipeline.py)
    sp_layout_delta_s: float = 0.0   # the plan's layout delta; the emulated body waits it too
    # "sptp": the members' nodes in group order; a group spanning nodes runs the hierarchical
    # collectives (sptp_hier.py). Empty: flat.
    sp_member_nodes: tuple[int, ...] = ()
    kv_ranges: tuple[KVRange, ...] = ()   # elastic decode: a target per token range instead
    # CSA (LOSSY, opt-in, ring chunks only; csa_ring.py): (p1, p2, p3). Empty: dense.
    csa_drop_ratios: tuple[float, ...] = ()
    csa_drop_queries: bool = True

    @property
    def instance(self) -> int:
        return self.group[self.rank]


class ChunkResult(msgspec.Struct, frozen=True):
    request_id: str
    chunk_index: int
    instance: int
    rank: int
    elapsed_s: float
    balance_wait_s: float = 0.0     # time spent blocked on cache balancing (exposed overhead)
    balance_sent_tokens: int = 0
    balance_recv_tokens: int = 0
    first_token: int | None = None
    logits: list[float] | None = None
    emulated: bool = False
    first_logprob: TokenLogprob | None = None   # when ``sampling.logprobs`` asks for it
    # the first token went to the decode ranks with the KV (transfer ``FirstToken``)
    first_token_streamed: bool = False
    sent_elements: int = 0   # what this member sent its chunk group (GroupExchange counts)


class PrefillResult(msgspec.Struct, frozen=True):
    request_id: str
    first_token: int | None
    logits: list[float] | None
    elapsed_s: float
    chunk_elapsed_s: tuple[float, ...]
    balance_wait_s: float            # per chunk the slowest member's wait, summed over chunks
    balance_moved_tokens: int
    kv_layout: tuple[tuple[int, Ranges], ...]   # (instance, positions) of the final group
    emulated: bool = False
    # ``elapsed_s`` runs from the first chunk's start: the wait for its turn (chunks queued
    # before it on its members) is ``queued_s``; the waits for later chunks' turns, inside
    # ``elapsed_s``, add up to ``turn_wait_s``.
    queued_s: float = 0.0
    turn_wait_s: float = 0.0
    # the first token's logprobs, when the request asked for them (the decode engines report
    # the later tokens'): ``LLMEngine.commit_prefilled`` takes them with the token
    first_logprob: TokenLogprob | None = None
    # the member that sampled the first token sent it to the decode ranks with the KV: the
    # decode instance starts without the dispatcher's ``commit``
    first_token_streamed: bool = False
    sent_elements: int = 0   # elements the chunk groups' attention sent, all chunks and members


def first_line(err: BaseException) -> str:
    """The first line of an error's text (a remote traceback's summary)."""
    text = str(err).strip().splitlines()
    return text[0] if text else ""
