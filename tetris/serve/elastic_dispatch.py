"""Elastic decode in the dispatcher (issue #25): a request's decode group, its ranges'
reservations, the prefill hand-off per range, the master's start and the group's release.

With ``[decode] elastic = true`` the dispatcher routes a request's first run through
``ElasticPlacer.place`` (tetris/control/elastic.py) instead of ``ControlPlane.route``, on the
same ``DecodeRouter`` (virtual usage per instance). A whole placement (one instance: the
router's own choice) goes on exactly as before. A group (no single instance has room, the free
room of several does: LoongServe's memory-triggered scale-up) is driven on the decode pool's
``ElasticWorld`` (actors/decode/elastic_pool.py) through the decode client:

1. ``elastic_place``: ``Hold`` on each holder, ``Lead`` and ``Reserve(kv_start)`` on the
   master (the last range), while the plan is made;
2. the prefill run streams each range to its holder (``kv_ranges``; the master's range as the
   run id, each held one as ``<id>@<start>``);
3. ``elastic_commit``: the master starts once every held range is on every rank of its holder;
   its stream is read as any request's;
   When the KV has arrived (``arrived``) the ranges' virtual usage goes, as a whole request's
   does, but the master's output room (``max_tokens``) stays booked on the master until the
   run ends: a whole request whose instance runs out of blocks is preempted and recomputed
   there, a split master cannot be (its earlier KV is elsewhere: the batcher raises), so its
   room must not be given to other requests (tests/serve/test_elastic_output_booking.py,
   tests/engine/test_elastic_output_room.py);
4. ``free``: the placer's usage of every member goes when the run ends, however it ends;
   ``elastic_release`` frees the ranges on every member (after the master's abort unless the
   run completed).

Only the memory trigger runs here: ``spread_for_time`` needs a decode step model of the served
deployment, which the dispatcher does not have for the model it serves (the simulator has one
per cluster). A run again after a lost instance (``HolderLost`` is an ``InstanceLost``) is
placed anew the same way (``reserve_again``), whole or over a group, around the lost one.
"""

from __future__ import annotations

from collections.abc import Sequence

from tetris.config import DeploymentConfig
from tetris.control.elastic import (
    DecodeGroup,
    ElasticConfig,
    ElasticPlacer,
    ExchangeModel,
)
from tetris.model.loader import resolve_model_config
from tetris.scheduler.router import DecodeRouter, NoInstanceUp
from tetris.serve.backend import Overloaded

__all__ = ["ElasticRouting", "make_routing", "range_id", "world_ranges"]


def _no_step_model(tp: int, batch: int, context: float) -> float:
    raise RuntimeError("the served placer has no decode step model (memory trigger only)")


def range_id(run_id: str, start: int, master: bool) -> str:
    # the master's range is the run itself; held ranges are named as the decode side holds
    # them (actors/decode/elastic.py: range_transfer_id)
    from tetris.actors.decode.elastic import range_transfer_id

    return run_id if master else range_transfer_id(run_id, start)


def world_ranges(group: DecodeGroup, prompt_tokens: int) -> list[tuple[int, int, int]]:
    """(instance, start, end) per range, clipped to the prompt: the output grows only at the
    master, past the prompt, and the prefill streams the prompt's KV alone."""
    out = []
    for r in group.ranges:
        out.append((r.instance, r.start, min(r.end, prompt_tokens)))
    return out


class ElasticRouting:
    """The placer and the groups of the runs placed over several instances."""

    def __init__(self, placer: ElasticPlacer) -> None:
        self.placer = placer
        self.groups: dict[str, list[tuple[int, int, int]]] = {}   # sharded runs only
        # (master, output tokens) of split runs: booked from ``arrived`` until ``free``
        self._output: dict[str, tuple[int, int]] = {}
        self._output_booked: set[str] = set()

    def route(self, run_id: str, prompt_tokens: int, max_tokens: int,
              avoid: frozenset[int] = frozenset()) -> DecodeGroup:
        """Place a run's KV (prompt and output; the output at the master), booking it."""
        try:
            group = self.placer.place(run_id, prompt_tokens + max_tokens, max_tokens, avoid)
        except NoInstanceUp as e:
            raise Overloaded(f"{e}: restarting, retry shortly", retry_after_s=2.0) from None
        if group.sharded:
            self.groups[run_id] = world_ranges(group, prompt_tokens)
            self._output[run_id] = (group.master, max_tokens)
        return group

    def ranges(self, run_id: str) -> list[tuple[int, int, int]] | None:
        return self.groups.get(run_id)

    def kv_ranges(self, run_id: str, receiver_ids) -> tuple:
        """The prefill pool's targets: each range to its instance's TP ranks."""
        from tetris.actors.prefill.messages import KVRange

        ranges = self.groups[run_id]
        return tuple(KVRange(s, e, range_id(run_id, s, k == len(ranges) - 1),
                             tuple(receiver_ids(i)))
                     for k, (i, s, e) in enumerate(ranges))

    async def reserve_again(self, decode, req, run_id: str, avoid: frozenset[int],
                            generated: tuple[int, ...]) -> int:
        """A run again after a lost instance (a lost holder too): placed anew around
        ``avoid``, whole or as a group, its prefill covering the prompt and ``generated``
        (the output the client has); reserved there. Returns its (master) instance."""
        done = len(generated)
        group = self.route(run_id, len(req.prompt_token_ids) + done,
                           req.sampling.max_tokens - done, avoid)
        if (ranges := self.ranges(run_id)) is None:
            await decode.reserve(group.master, run_id, req.prompt_token_ids, req.sampling,
                                 generated)
        else:
            await decode.elastic_place(run_id, req.prompt_token_ids, req.sampling, ranges,
                                       generated)
        return group.master

    def arrived(self, run_id: str) -> None:
        """The KV is on every holder: the ranges' virtual usage goes, except a split master's
        output room, which stays booked until the run ends (it cannot be preempted)."""
        self.placer.arrived(run_id)
        if run_id in self._output and run_id not in self._output_booked:
            master, tokens = self._output[run_id]
            self.placer.router.reserve(master, tokens)
            self._output_booked.add(run_id)

    async def free(self, decode, run_id: str, *, completed: bool) -> None:
        """The run ended: the placer's usage of every member goes, and a group's ranges are
        released on every member (the master's request aborted first unless it completed)."""
        self.placer.finished(run_id)
        master, tokens = self._output.pop(run_id, (0, 0))
        if run_id in self._output_booked:
            self._output_booked.discard(run_id)
            self.placer.router.release(master, tokens)
        ranges = self.groups.pop(run_id, None)
        if ranges is None:
            return
        if not completed:
            await decode.abort(ranges[-1][0], run_id)
        await decode.elastic_release(run_id, ranges)


def make_routing(deployment: DeploymentConfig, router: DecodeRouter,
                 capacities: Sequence[int]) -> ElasticRouting | None:
    """The dispatcher's elastic routing, or None when ``[decode] elastic`` is off."""
    if not deployment.decode.elastic:
        return None
    m = resolve_model_config(deployment.model)
    exchange = ExchangeModel(num_layers=m.num_layers, num_heads=m.num_heads,
                             num_kv_heads=m.num_kv_heads, head_dim=m.attention_head_dim)
    config = ElasticConfig(enabled=True, max_group=deployment.decode.num_instances,
                           spread_for_time=False)
    return ElasticRouting(ElasticPlacer(router, capacities, _no_step_model,
                                        deployment.decode.tp_size, exchange, config))
