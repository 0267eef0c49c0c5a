"""Where the pools' actors run: Ray placement groups, and the node map the scheduler plans with.

Rules (docs/prefill.md, docs/decode.md):

1. Prefill: one placement group per pool, one bundle per instance (``cpus_per_instance`` CPUs,
   ``gpus_per_instance`` GPUs), strategy PACK ("pack") or SPREAD ("spread"). Bundles are
   grouped by node (nodes in first-seen bundle order), so the instances of one node have
   consecutive indices, like the configured virtual nodes.
2. Decode: one placement group per instance, one bundle per TP rank, STRICT_PACK (a TP group
   never spans nodes); rank r runs in bundle r.
3. "auto" is "pack" on a multi-node cluster and "none" on a single node, where every actor is on
   the one node anyway and the tiny deployment must still start on a 2-core box. "none" places
   nothing: actors reserve no CPU (they mostly wait on each other) and Ray picks their nodes;
   an actor still asks for its bundle's GPUs, so that Ray gives it its devices.
4. A placement group not ready within the timeout is removed and a ``PlacementError`` names
   the resources it lacks.
   Bundles asking for more GPUs than the whole cluster has fail at once with a ``ConfigError``
   naming CUDA (tetris/device.py), in every mode: such an actor would otherwise wait forever.
5. The node map (``node_map``) comes from the Ray node each actor reports: distinct node ids in
   first-seen order. On one node the configured virtual nodes of ``node_size`` are kept; on
   several, the real nodes win (a WARNING when a node holds other than ``node_size``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray

from tetris.actors.process_env import runtime_env
from tetris.config import DecodeConfig, PrefillConfig
from tetris.device import check_device_bundles

__all__ = ["Placement", "PlacementError", "node_map", "place_prefill", "place_decode",
           "prefill_bundles", "decode_bundles",
           "resolve_mode", "explain_unplaced", "alive_nodes", "PLACEMENT_TIMEOUT_S"]

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
_STRATEGY = {"pack": "PACK", "spread": "SPREAD"}


class PlacementError(RuntimeError):
    """A placement group could not be placed on the cluster in time."""


class Placement:
    """A ready placement group and the bundle each member of the group of actors runs in.

    Without a group (mode "none") members get no scheduling constraint and reserve nothing.
    """

    def __init__(self, mode: str, pg=None, bundle_of: Sequence[int] = (),
                 node_ids: Sequence[str] = (), gpus: float = 0.0) -> None:
        self.mode = mode
        self.pg = pg
        self.bundle_of = tuple(bundle_of)
        self.node_ids = tuple(node_ids)   # the node of each member's bundle, as Ray placed it
        self.gpus = gpus

    def options(self, member: int) -> dict:
        """``ActorClass.options(...)`` for member ``member``."""
        # num_cpus=0: the bundle holds the reservation; actors in it may share its CPUs.
        opts: dict = {"num_cpus": 0, "runtime_env": runtime_env()}
        if self.gpus:
            opts["num_gpus"] = self.gpus   # so that Ray assigns the bundle's devices to it
        if self.pg is None:
            return opts
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.bundle_of[member])
        return opts

    def remove(self) -> None:
        if self.pg is not None:
            from ray.util import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None


def node_map(node_ids: Sequence[str], node_size: int) -> list[int]:
    """Each member's node index: virtual nodes on one Ray node, real nodes otherwise (rule 5)."""
    if node_size <= 0:
        raise ValueError(f"node_size must be positive, got {node_size}")
    distinct = list(dict.fromkeys(node_ids))
    if len(distinct) <= 1:
        return [i // node_size for i in range(len(node_ids))]
    index = {n: k for k, n in enumerate(distinct)}
    out = [index[n] for n in node_ids]
    counts = [out.count(k) for k in range(len(distinct))]
    if any(c != node_size for c in counts):
        log.warning("prefill instances per Ray node are %s, the deployment says node_size=%d: the "
                    "scheduler plans with the real nodes", counts, node_size)
    return out


def alive_nodes() -> list[dict]:
    """[{"node_id": ..., "resources": {...}}] of the cluster's live nodes, in Ray's order."""
    return [{"node_id": n["NodeID"], "resources": dict(n.get("Resources", {}))}
            for n in ray.nodes() if n.get("Alive")]


def resolve_mode(mode: str, num_nodes: int) -> str:
    """"auto" -> "pack" on several nodes, "none" on one (rule 3); other modes stay."""
    if mode == "auto":
        return "pack" if num_nodes > 1 else "none"
    return mode


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    out = {}
    if cpus > 0:
        out["CPU"] = float(cpus)
    if gpus > 0:
        out["GPU"] = float(gpus)
    return out


def prefill_bundles(pc: PrefillConfig, num_instances: int) -> list[dict[str, float]]:
    """The pool's bundles (rule 1): one per instance, its CPUs and GPUs (GPUs as
    ``tetris.device.with_device_defaults`` filled them in from ``model.device``)."""
    return [_bundle(pc.cpus_per_instance, pc.gpus_per_instance) for _ in range(num_instances)]


def decode_bundles(dc: DecodeConfig) -> list[dict[str, float]]:
    """One decode instance's bundles (rule 2): one per TP rank."""
    return [_bundle(dc.cpus_per_rank, dc.gpus_per_rank) for _ in range(dc.tp_size)]


def _check_gpus(bundles: list[dict[str, float]], nodes: list[dict], what: str) -> None:
    check_device_bundles(bundles, sum(n["resources"].get("GPU", 0.0) for n in nodes), what)


def place_prefill(pc: PrefillConfig, num_instances: int, *, mode: str | None = None,
                  timeout_s: float = PLACEMENT_TIMEOUT_S) -> Placement:
    """The pool's placement (rule 1): instance i in bundle ``bundle_of[i]``."""
    nodes_alive = alive_nodes()
    bundles = prefill_bundles(pc, num_instances)
    what = f"the prefill pool ({num_instances} instances)"
    _check_gpus(bundles, nodes_alive, what)
    mode = resolve_mode(mode or pc.placement, len(nodes_alive))
    if mode == "none":
        return Placement("none", gpus=pc.gpus_per_instance)
    if mode not in _STRATEGY:
        raise ValueError(f"prefill placement must be auto, pack, spread or none, got {mode!r}")
    pg, nodes = _place(bundles, _STRATEGY[mode], timeout_s, what)
    first_seen = {n: k for k, n in enumerate(dict.fromkeys(nodes))}
    order = sorted(range(num_instances), key=lambda b: (first_seen[nodes[b]], b))
    return Placement(mode, pg, order, [nodes[b] for b in order], pc.gpus_per_instance)


def place_decode(dc: DecodeConfig, instance: int, *, mode: str | None = None,
                 timeout_s: float = PLACEMENT_TIMEOUT_S) -> Placement:
    """Decode instance ``instance``'s placement (rule 2): rank r in bundle r, one node."""
    nodes_alive = alive_nodes()
    bundles = decode_bundles(dc)
    what = f"decode instance {instance} (TP {dc.tp_size})"
    _check_gpus(bundles, nodes_alive, what)
    mode = resolve_mode(mode or dc.placement, len(nodes_alive))
    if mode == "none":
        return Placement("none", gpus=dc.gpus_per_rank)
    if mode != "pack":
        raise ValueError(f"decode placement must be auto, pack or none, got {mode!r}")
    pg, nodes = _place(bundles, "STRICT_PACK", timeout_s, what)
    return Placement(mode, pg, range(dc.tp_size), nodes, dc.gpus_per_rank)


def _place(bundles: list[dict[str, float]], strategy: str, timeout_s: float,
           what: str) -> tuple[object, list[str]]:
    """Create a placement group and wait for it; (group, node id of each bundle)."""
    from ray.util import placement_group, placement_group_table, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    if not pg.wait(timeout_seconds=max(1, round(timeout_s))):
        # A pending group would grab the resources whenever they appear: give it up.
        remove_placement_group(pg)
        raise PlacementError(f"{what}: placement group not ready after {timeout_s:.0f}s; "
                             + explain_unplaced(bundles, strategy, alive_nodes(),
                                                ray.available_resources()))
    table = placement_group_table(pg)["bundles_to_node_id"]
    return pg, [table[b] for b in range(len(bundles))]


def explain_unplaced(bundles: list[dict[str, float]], strategy: str, nodes: list[dict],
                     available: dict[str, float]) -> str:
    """Which resources a placement group lacks, for the error message (pure)."""
    need: dict[str, float] = {}
    for b in bundles:
        for r, v in b.items():
            need[r] = need.get(r, 0.0) + v
    missing = {r: v - available.get(r, 0.0) for r, v in sorted(need.items())
               if v > available.get(r, 0.0) + 1e-9}
    text = (f"{len(bundles)} bundles of {_fmt(bundles[0])} ({strategy}) need {_fmt(need)}; "
            f"available now: {_fmt({r: available.get(r, 0.0) for r in sorted(need)})}")
    if missing:
        text += f"; missing {_fmt(missing)}"
    per_node = need if strategy == "STRICT_PACK" else bundles[0]
    fits = [n for n in nodes
            if all(n["resources"].get(r, 0.0) + 1e-9 >= v for r, v in per_node.items())]
    if not fits:
        where = "all bundles together" if strategy == "STRICT_PACK" else "one bundle"
        sizes = ", ".join(
            f"{n['node_id'][:8]} {_fmt({r: n['resources'].get(r, 0.0) for r in per_node})}"
            for n in nodes)
        text += f"; no node is big enough for {where} ({_fmt(per_node)}; nodes: {sizes or 'none'})"
    return text


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{r}: {v:g}" for r, v in sorted(resources.items())) + "}"
