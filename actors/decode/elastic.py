"""A decode rank's part in elastic decode (issue #25): the commands and the rank's membership.

Rank r of every decode instance joins one *elastic world* (a gloo group of its own, beside
the instance's TP world: the prefill pool's ``World``), so rank r of a master exchanges its
head slice of q and of the partials with rank r of each holder. The engine side is
``tetris.engine.elastic_rows.ElasticRows``; this module gives it the driver's commands and the
KV hand-off through the transfer layer:

- ``Reserve(kv_start=s)`` (messages.py) makes this instance a request's *master*: blocks for
  ``[s, n)`` only, its KV arriving as transfer ``request_id`` in range-local positions
  ``[0, n - s)``; ``Lead`` then names the instances holding ``[0, s)``.
- ``Hold`` keeps ``[start, end)`` of a request mastered elsewhere: blocks from the engine's
  pool now, its KV arriving as transfer ``range_transfer_id(request_id, start)`` in
  range-local positions; the ready event carries that id.
- ``Release`` forgets the request here (finished, aborted, lost): held ranges freed, a pending
  range transfer aborted. The master's own sequence goes with the engine's request.

Every rank of the world runs ``round`` once per driver round, whether or not its engine has
work (a holder answers between its peers' layers). A request that lost a holder comes back in
``StepReply.failed`` (``Failed``, which the driver treats like a transfer failure: the resume
path).
"""

from __future__ import annotations

import time
from datetime import timedelta

import msgspec
from tetris.actors.decode.messages import Failed, Rejected

from tetris.engine.elastic_rows import ElasticRows
from tetris.sampling_params import SamplingParams

__all__ = ["HOLDER_LOST", "ElasticMember", "Hold", "Lead", "Release", "range_transfer_id"]

HOLDER_LOST = "elastic decode: an instance holding part of its KV was lost"


def range_transfer_id(request_id: str, start: int) -> str:
    """The transfer id of a held range: its KV arrives apart from the master's."""
    return f"{request_id}@{start}"


class Lead(msgspec.Struct, frozen=True, tag="lead"):
    """This instance masters ``request_id`` (reserved with ``kv_start``); ``holders`` keep
    its earlier ranges. ``key`` names the request on the elastic world's wire. ``line``:
    holders that master next, in order, when this instance has no block for the next token
    (engine/elastic_handover.py; each got the request with its ``Hold``)."""

    request_id: str
    key: int
    holders: tuple[int, ...]
    line: tuple[int, ...] = ()


class Hold(msgspec.Struct, frozen=True, tag="hold"):
    """Keep tokens ``[start, end)`` of ``request_id``, mastered by instance ``master``. With
    ``sampling`` this instance is in the master's line: the prompt and sampling parameters
    it masters the request with if handed it."""

    request_id: str
    key: int
    master: int
    start: int
    end: int
    prompt_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams | None = None


class Release(msgspec.Struct, frozen=True, tag="release"):
    """Forget ``request_id`` here: its held ranges are freed (idempotent)."""

    request_id: str


ELASTIC_COMMANDS = (Lead, Hold, Release)


def _rows_for(rank) -> type:
    """``ElasticRows``, or for an emulated engine (EMULATION) ``EmulatedElasticRows``; the rank
    built its engine before it knew it would join a world, so it becomes the elastic one
    here (``elastic_emulated.make_elastic``)."""
    from tetris.actors.decode.emulated import EmulatedDecodeEngine

    if not isinstance(rank.engine, EmulatedDecodeEngine):
        return ElasticRows
    from tetris.actors.decode.elastic_emulated import EmulatedElasticRows, make_elastic

    make_elastic(rank.engine, rank.deployment)
    return EmulatedElasticRows


class ElasticMember:
    """Instance ``index`` of ``size`` in the elastic world ``world`` (a peer link), on
    ``rank`` (a ``DecodeRank`` whose engine is loaded and whose transfer is enabled)."""

    def __init__(self, rank, index: int, size: int, world) -> None:
        self.rank = rank
        self.world = world
        self.rows = _rows_for(rank)(rank.engine, index, size, world)
        self._pending: dict[str, str] = {}   # range transfer id -> request, until released

    @classmethod
    def join(cls, rank, index: int, size: int, host: str, port: int, timeout_s: float,
             listen_host: str) -> ElasticMember:
        """Join the world: instance 0's rank serves its store at ``host:port``; this rank
        listens on ``listen_host`` (every member at once, ``SocketWorld``)."""
        import torch.distributed as dist
        from tetris.actors.decode.elastic_link import SocketWorld

        store = dist.TCPStore(host, port, size, index == 0, timeout=timedelta(seconds=timeout_s))
        return cls(rank, index, size, SocketWorld(store, index, size, listen_host, timeout_s))

    def apply(self, cmd) -> Rejected | None:
        rid = cmd.request_id
        try:
            if isinstance(cmd, Lead):
                self.rows.master(rid, cmd.key, list(cmd.holders), line=cmd.line)
            elif isinstance(cmd, Hold):
                return self._hold(cmd)
            elif isinstance(cmd, Release):
                self._release(rid)
            else:
                raise TypeError(f"not an elastic command: {type(cmd).__name__}")
        except ValueError as exc:
            return Rejected(rid, str(exc))
        return None

    def _hold(self, cmd: Hold) -> Rejected | None:
        rank = self.rank
        if rank.pump is None:
            return Rejected(cmd.request_id, "this decode instance has no KV transfer enabled")
        n = cmd.end - cmd.start
        if n <= 0 or not rank.engine.blocks.can_allocate(n):
            return Rejected(cmd.request_id, f"range [{cmd.start}, {cmd.end}) does not fit "
                            f"{rank.engine.num_free_blocks} free blocks", full=n > 0)
        shard = self.rows.hold(cmd.request_id, cmd.key, cmd.master, cmd.start, n)
        tid = range_transfer_id(cmd.request_id, cmd.start)
        # as for Reserve: the manager sees the range's blocks before any handshake can
        with rank.pump.locked() as manager:
            rank._blocks.lend(shard.block_table)
            try:
                ok = manager.reserve(tid, n, time.monotonic())
            finally:
                rank._blocks.lend(None)
        if not ok:
            self.rows.release(cmd.request_id)
            return Rejected(cmd.request_id, f"the receive manager refused transfer {tid}")
        if cmd.sampling is not None:
            self.rows.heir(cmd.request_id, cmd.key, cmd.prompt_token_ids, cmd.sampling)
        self._pending[tid] = cmd.request_id
        return None

    def _release(self, request_id: str) -> None:
        pump = self.rank.pump
        for tid in [t for t, r in self._pending.items() if r == request_id]:
            del self._pending[tid]
            if pump is not None:
                with pump.locked() as manager:
                    manager.abort(tid, "released", time.monotonic())
        self.rows.release(request_id)

    def round(self) -> tuple[list, list[Failed]]:
        """The engine's step in the world's lockstep: (outputs, requests that lost a holder)."""
        outputs, failed = self.rows.round()
        return outputs, [Failed(rid, HOLDER_LOST, holder_lost=True) for rid in failed]
