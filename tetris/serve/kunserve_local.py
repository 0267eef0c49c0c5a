"""KunServe over in-process engines: the control plane's decisions applied to real engines.

``LocalKunServe.tick()`` is one monitor period: it reports every unit's KV (an undropped
engine, or a group's leader) to the same ``KunServeController`` the simulator uses, and
applies what it decides with ``tetris.engine.pipeline_group``: a drop merges engines into a
pipeline (KV exchanged, nothing recomputed), a restore splits a group back. The memory model
comes from the engines' real tensors (parameter bytes per layer, cache bytes). A plan this
driver cannot apply (it merges an existing group again; an engine mid-receive) is undone in
the controller and kept in ``refused``, so both sides agree on the grouping.
"""

from __future__ import annotations

from tetris.control.drop_plan import Group
from tetris.control.kunserve import KunServeController
from tetris.control.kunserve_memory import InstanceLoad, InstanceMemory
from tetris.engine.engine import LLMEngine
from tetris.engine.pipeline import layer_bytes
from tetris.engine.pipeline_group import PipelineGroup, drop, layer_block_bytes

__all__ = ["LocalKunServe", "engine_memory"]


def engine_memory(engine: LLMEngine) -> InstanceMemory:
    """``InstanceMemory`` of an undropped engine, from its tensors."""
    model = engine.model
    per_layer = layer_bytes(model.layers[0])
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = engine.cache.buffer
    return InstanceMemory(num_layers=model.num_layers, layer_param_bytes=per_layer,
                          other_param_bytes=total - model.num_layers * per_layer,
                          kv_bytes=cache.numel() * cache.element_size(),
                          layer_block_bytes=layer_block_bytes(engine),
                          block_size=engine.blocks.block_size)


class LocalKunServe:
    def __init__(self, engines: list[LLMEngine], controller: KunServeController | None = None):
        self.engines = engines
        self.controller = controller or KunServeController(engine_memory(engines[0]),
                                                           list(range(len(engines))))
        self.groups: dict[int, PipelineGroup] = {}    # by leader index
        self.refused: list[str] = []

    def serving(self) -> list[LLMEngine]:
        """The engines that step now: undropped ones and group leaders."""
        return [self.engines[g.members[0]] for g in self.controller.groups]

    def load(self, engine: LLMEngine) -> InstanceLoad:
        s = engine.stats()
        queued = [q for q in engine.batcher.waiting]
        head = sum(engine.blocks.blocks_needed(q.num_tokens + 1) for q in queued)
        return InstanceLoad(s.total_blocks, s.total_blocks - s.free_blocks, 0, head)

    def tick(self) -> str | None:
        """One monitor period; returns "drop", "restore" or None."""
        before = list(self.controller.groups)
        loads = {g.members[0]: self.load(self.engines[g.members[0]]) for g in before}
        decision = self.controller.decide(loads)
        if decision is None:
            return None
        try:
            if decision.kind == "drop":
                self._apply_drop(before, list(decision.drop.groups))
            else:
                self.groups.pop(decision.restored_group.members[0]).restore()
        except ValueError as e:
            self.controller.groups = before
            self.refused.append(str(e))
            return None
        return decision.kind

    def _apply_drop(self, before: list[Group], after: list[Group]) -> None:
        new = [g for g in after if g not in before]
        if any(len(g.members) > 1 for g in before if g not in after):
            raise ValueError("this driver merges undropped engines only; restore first")
        for g in new:   # every check of each drop runs before it changes anything
            group = drop([self.engines[m] for m in g.members], list(g.layer_ranges))
            self.groups[g.members[0]] = group
